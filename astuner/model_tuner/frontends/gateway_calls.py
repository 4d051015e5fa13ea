"""A gateway request's call, run on its episode: the key's entry, the call on the episode's event loop, its
failures as (status, message, code, error type), and the delivery that un-records a call nobody received
(`ModelTuner.discard`). The routes (gateway_openai.py, gateway_anthropic.py) shape what these return."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from astuner.model_tuner.chat_format import TemplateRefused
from astuner.model_tuner.turn import CallOptions, EpisodeOverflow, EpisodeTimeout

log = logging.getLogger("astuner.model_tuner.frontends.gateway")  # the gateway's log, whichever of its modules writes


@dataclass
class Entry:
    """What a key opens: its episode's tuner, the options its calls are recorded with, the episode's loop."""

    tuner: Any  # ModelTuner
    options: CallOptions
    loop: asyncio.AbstractEventLoop | None


async def complete(entry: Entry, messages: list[dict], tools, options):
    """(turn, None), or (None, (status, message, code, error type)) for a call that failed."""
    try:
        return await run_on_episode_loop(entry, entry.tuner.complete(messages, tools, options)), None
    except asyncio.CancelledError:
        # A request whose own task is being cancelled (a client that hung up, an in-process agent cancelled
        # with its episode) stays cancelled. Otherwise the call was cut on the episode's side: the deadline
        # aborted it in the engine, or the episode ended and cancelled what it left running. Either is an
        # answer the client can read, not a server error, and a retry would meet an ended episode.
        current = asyncio.current_task()
        if current is not None and getattr(current, "cancelling", lambda: 0)():
            raise
        if entry.tuner.expired:
            return None, (408, f"{entry.tuner.expired_reason}: the call was cut", "episode_timeout", "timeout")
        return None, (408, "the episode ended while this call was generating (its workflow returned or was "
                           "cancelled): nothing was recorded, and a retry would find the episode over",
                      "episode_ended", "timeout")
    except Exception as exc:  # noqa: BLE001 - every failure becomes an API-shaped error
        return None, failure(exc)


def failure(exc: Exception) -> tuple[int, str, str, str]:
    """(status, message, code, error type) for a call that raised."""
    if isinstance(exc, EpisodeOverflow):
        return 400, str(exc), "context_length_exceeded", "invalid_request_error"
    if isinstance(exc, EpisodeTimeout):
        return 408, str(exc), "episode_timeout", "timeout"
    if isinstance(exc, TemplateRefused):  # e.g. a template that requires alternating roles, or a string id
        return 400, str(exc), "invalid_request", "invalid_request_error"
    log.exception("gateway: call failed")
    return 500, f"{type(exc).__name__}: {exc}", "internal_error", "server_error"


async def run_on_episode_loop(entry: Entry, coro):
    """Await `coro` on the episode's loop (where the tuner's state lives), from whichever loop the request is on."""
    loop = entry.loop
    running = asyncio.get_running_loop()
    if loop is None or loop is running:
        return await coro
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the episode this key belongs to has ended")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def discard_on_episode_loop(entry: Entry, call) -> None:
    """Un-record `call` (`ModelTuner.discard`) on the episode's loop."""
    loop = entry.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or loop is running or loop.is_closed():
        entry.tuner.discard(call)
    else:
        loop.call_soon_threadsafe(entry.tuner.discard, call)  # the tuner's state belongs to its loop


def hung_up(entry: Entry, turn):
    """The client left while the call generated: nobody will read the answer (a retry may come)."""
    from starlette.responses import Response

    discard_on_episode_loop(entry, turn.call)
    return Response(status_code=499)  # nginx's "client closed request"; no client is left to read it


class Delivery:
    """An ASGI response that un-records its call unless its last byte was handed to the server before the client
    was seen to leave. A send that fails says so, but uvicorn drops sends to a client that left without an error
    and tells of it only as `http.disconnect` on receive: a watcher listens for it while the answer goes out, and
    each chunk yields to the loop so the watcher runs between chunks (else a stream is written in one go, blind).
    A disconnect seen after the last chunk was sent is a client closing a delivered answer: the call stays."""

    def __init__(self, entry: Entry, turn, response) -> None:
        self.entry, self.turn, self.response = entry, turn, response

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import ClientDisconnect

        left = asyncio.Event()
        delivered = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass  # the body was read by the route: nothing else is expected but the disconnect
            left.set()

        async def tracked(message) -> None:
            nonlocal delivered
            if left.is_set():
                raise ClientDisconnect()  # stop streaming to nobody
            await send(message)
            if message["type"] != "http.response.body":
                return
            if not message.get("more_body", False):
                delivered = True
            else:
                await asyncio.sleep(0)  # the watcher's turn: a departure is seen before the next chunk

        watcher = asyncio.ensure_future(watch())
        try:
            await self.response(scope, receive, tracked)
        except (ClientDisconnect, OSError):
            pass  # the client is gone: there is nobody to answer, and nothing went wrong here
        finally:
            watcher.cancel()
            if not delivered:
                discard_on_episode_loop(self.entry, self.turn.call)
