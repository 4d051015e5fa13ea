"""The remote agents' client and board without a model: a board served on loopback, offers made by hand, the real
`astuner_remote.RemoteClient` taking them. Whatever one episode does, no other is dropped; a stopped client
reports what it ran; a take is idempotent; an episode's deadline starts when it is taken."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from astuner.serve.remote_board import EpisodeBoard, RemoteAgentError


@pytest.fixture()
def board(tmp_path):
    """A board on loopback (no keys) and an event loop of its own, where the offers live (as the run's)."""
    from astuner.serve import Server
    from astuner.serve.keys import KeyStore
    from astuner.serve.remote_app import RemoteApp

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    board = EpisodeBoard(episode_timeout_s=60.0)
    server = Server(RemoteApp(board, KeyStore(tmp_path / "keys.json")), KeyStore(tmp_path / "keys.json"))
    board.public_url = server.start()
    board.loop = loop
    yield board
    server.stop()
    loop.call_soon_threadsafe(loop.stop)


def offer(board, *tasks: dict, on_take=None, on_end=None) -> list:
    async def make():
        return [board.offer({"task": task, "base_url": "", "api_key": "k", "model": "policy"}, on_take, on_end)
                for task in tasks]

    return asyncio.run_coroutine_threadsafe(make(), board.loop).result(5)


def outcome(offer, timeout: float = 10.0):
    async def wait():
        try:
            return await asyncio.wait_for(asyncio.shield(offer.future), timeout)
        except RemoteAgentError as exc:
            return exc

    return asyncio.run_coroutine_threadsafe(wait(), offer.loop).result(timeout + 5)


def test_one_episodes_failure_never_drops_another(board):
    """numpy values are sent as numbers; a result that is not JSON, and an agent that raises, become those
    episodes' errors, and the client goes on with the rest (before, the first of them ended the whole client)."""
    from astuner_remote import RemoteClient

    offers = offer(board, {"kind": "numpy"}, {"kind": "object"}, {"kind": "raise"}, {"kind": "plain"})

    async def agent(episode):
        kind = episode.task["kind"]
        if kind == "raise":
            raise ValueError("the agent broke")
        if kind == "object":
            return {"metadata": {"handle": object()}}
        if kind == "numpy":
            return {"reward": np.float32(0.5), "metadata": {"x": np.float64(1.5), "xs": np.arange(3)}}
        return 1.0

    posted = RemoteClient(board.public_url, name="c").run(agent, concurrency=1, episodes=4)
    results = [outcome(o) for o in offers]
    assert posted == 4
    assert results[0].reward == 0.5 and results[0].metadata["x"] == 1.5 and results[0].metadata["xs"] == [0, 1, 2]
    assert isinstance(results[1], RemoteAgentError) and "not JSON" in str(results[1])
    assert isinstance(results[2], RemoteAgentError) and "the agent broke" in str(results[2])
    assert results[3].reward == 1.0


def test_a_client_takes_no_more_than_asked_and_counts_only_what_the_run_took(board):
    from astuner_remote import RemoteClient

    offers = offer(board, *({"i": i} for i in range(4)))

    async def late(episode):  # its episode ends (its deadline passes) before the result is posted
        gone = next(o for o in offers if o.episode_id == episode.episode_id)
        board.loop.call_soon_threadsafe(board.withdraw, gone)
        await asyncio.sleep(0.3)
        return 1.0

    client = RemoteClient(board.public_url, name="c")
    assert client.run(late, concurrency=4, episodes=2, idle_exit_s=3) == 0  # 410s: not counted
    assert board.taken == 2  # concurrency 4, episodes 2: two taken, not four


def test_a_result_ends_its_episodes_calls_before_the_client_hears_it_was_taken(board):
    """The episode's keys are revoked when its result (or error) is accepted, before the answer: a call the client
    makes after posting is refused, not recorded into the episode while the run's loop has yet to end it."""
    from astuner_remote import RemoteClient

    ended = []
    offers = offer(board, {"i": 0}, {"i": 1}, on_end=lambda: ended.append(board.counts()["finished"]))
    client = RemoteClient(board.public_url, name="c")
    first = client.next_episode(wait_s=5)
    assert ended == []  # taken, not ended
    assert client.post_result(first, 1.0) and ended == [1]  # ended when the answer came
    second = client.next_episode(wait_s=5)
    assert client.post_error(second, "the agent broke") and ended == [1, 2]
    results = [outcome(o) for o in offers]
    assert results[0].reward == 1.0 and "the agent broke" in str(results[1])


@pytest.mark.slow
def test_a_stopped_client_reports_what_it_was_running(board):
    from astuner_remote import RemoteClient

    offers = offer(board, {"i": 0}, {"i": 1})

    async def forever(episode):
        await asyncio.Event().wait()

    async def main():
        task = asyncio.ensure_future(RemoteClient(board.public_url, name="c").run_async(forever, concurrency=2))
        while board.taken < 2:
            await asyncio.sleep(0.05)
        task.cancel()  # Ctrl-C in asyncio.run, or the caller's own cancel
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    for o in offers:
        got = outcome(o)
        assert isinstance(got, RemoteAgentError) and "client stopped" in str(got)


def test_a_take_sent_again_gets_the_same_episode(board):
    offer(board, {"i": 0}, {"i": 1})
    with httpx.Client(base_url=board.public_url, headers={"X-API-Key": "tml-x", "X-Astuner-Client": "c"}) as http:
        first = http.post("/astuner/v1/episodes/next", json={"wait_s": 1, "take_token": "t1"}).json()["episode"]
        again = http.post("/astuner/v1/episodes/next", json={"wait_s": 1, "take_token": "t1"}).json()["episode"]
        other = http.post("/astuner/v1/episodes/next", json={"wait_s": 1, "take_token": "t2"}).json()["episode"]
        foreign = httpx.post(f"{board.public_url}/astuner/v1/episodes/next", json={"wait_s": 0, "take_token": "t1"},
                             headers={"X-API-Key": "tml-x", "X-Astuner-Client": "d"}).json()["episode"]
    assert first["episode_id"] == again["episode_id"] != other["episode_id"]
    assert foreign is None  # another client's token takes nothing of the first's (and nothing is left)
    assert board.taken == 2


@pytest.mark.slow
def test_an_episodes_deadline_starts_when_it_is_taken(board):
    """Offers wait for a free client without losing time: the one taken 1.5 s after it was offered still has its
    whole episode_timeout, and the run's deadline for it moves to the take (the callback)."""
    board.episode_timeout_s, board.take_timeout_s = 1.0, 30.0
    taken = []
    offer(board, {"i": 0}, on_take=lambda client, deadline: taken.append((client, deadline)))
    time.sleep(1.5)
    got = board.take("local/c")
    assert got["deadline_s"] == 1.0
    assert taken and taken[0][0] == "local/c" and abs(taken[0][1] - (time.monotonic() + 1.0)) < 0.5
    board.take_timeout_s = 0.2
    offer(board, {"i": 1})
    time.sleep(0.4)
    assert board.take("local/c") is None  # waited past its take bound: nobody may take it any more


def test_only_a_finished_run_tells_the_clients_it_is_over(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM on `astuner serve` stops a run that the same command resumes: the board must not say
    `run_over` then (clients waiting for an episode would exit); a run that finished says it."""
    import typer

    from astuner import cli_serve, launch
    from astuner.interrupts import Terminated
    from astuner.serve.keys import KeyStore

    boards = []  # the board each run's workflow offers its episodes on

    def serve_once() -> None:
        cli_serve._serve_remote_agents("x.yaml", [], KeyStore(tmp_path / "keys.json"), "127.0.0.1", 0, None, False,
                                       60.0, None)

    for stop in (Terminated, KeyboardInterrupt):
        def stopped(*args, workflow, **kwargs):
            boards.append(workflow.board)
            raise stop()

        monkeypatch.setattr(launch, "run", stopped)
        with pytest.raises(typer.Exit):
            serve_once()
        assert boards[-1].run_over is False, stop
    monkeypatch.setattr(launch, "run", lambda *args, workflow, **kwargs: boards.append(workflow.board))
    serve_once()
    assert boards[-1].run_over is True


def test_the_server_stays_up_until_every_recent_client_heard_the_run_is_over(board):
    """A client between two takes when the run ends (running its last episode) asks again a moment later: the
    server must still answer it `run_over`, or the client retries a closed address until its reconnect_s."""
    asyncio.run_coroutine_threadsafe(board.wait_take("busy", 0.0), board.loop).result(5)  # it asked once, then works
    board.run_over = True
    waited = threading.Thread(target=board.wait_told, args=(30.0, 30.0))
    waited.start()
    time.sleep(0.5)
    assert waited.is_alive()  # the busy client has not heard it yet
    assert asyncio.run(board_next(board, "busy")) is None  # its next take: told
    waited.join(timeout=5)
    assert not waited.is_alive()
    start = time.monotonic()
    board.wait_told(30.0, 30.0)  # everyone told: no wait
    assert time.monotonic() - start < 1.0


async def board_next(board, client):
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(board.wait_take(client, 1.0), board.loop))


def test_a_client_stopped_while_its_take_is_answered_reports_that_episode_too(board, monkeypatch):
    from astuner_remote import RemoteClient

    offers = offer(board, {"i": 0})
    real_next = RemoteClient._next

    async def slow_answer(self, wait_s):  # the server gave the episode; its answer is still on the way
        got = await real_next(self, wait_s)
        await asyncio.sleep(0.5)
        return got

    monkeypatch.setattr(RemoteClient, "_next", slow_answer)

    async def main():
        task = asyncio.ensure_future(RemoteClient(board.public_url, name="c").run_async(lambda e: None))
        while board.taken < 1:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    got = outcome(offers[0], timeout=5.0)
    assert isinstance(got, RemoteAgentError) and "client stopped" in str(got)


def test_requests_share_one_tls_context(board, monkeypatch):
    """httpx reads the whole CA bundle for each client it builds (~20 ms of CPU, more than a loopback request): the
    client's requests, each with a client of its own, and the agents' OpenAI clients, one per episode, share one."""
    import ssl

    import astuner_remote
    from astuner_remote import RemoteClient

    built, real = [], ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    astuner_remote._tls_context.cache_clear()
    client = RemoteClient(board.public_url, name="c")

    async def agent(episode):
        assert episode.openai_client()._client is not episode.openai_client(sync=True)._client
        return 1.0

    offers = offer(board, {"i": 0})
    assert client.run(agent, concurrency=1, episodes=1) == 1  # imports done, the shared context built
    assert len(built) >= 1
    built.clear()
    offers += offer(board, *({"i": i} for i in range(1, 4)))
    assert client.run(agent, concurrency=1, episodes=3) == 3 and client.status()
    assert [outcome(o).reward for o in offers] == [1.0] * 4 and built == []
