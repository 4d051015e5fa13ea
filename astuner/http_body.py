"""What astuner's HTTP apps (the Tinker API and the remote agents' board of `astuner serve`, the run's OpenAI and
Anthropic gateway) share: an HTTP failure with its status, and request bodies read within a size limit (a client
on the network may send anything); and the TLS context its HTTP clients share."""

from __future__ import annotations

import functools
import json


class HttpError(Exception):
    """A request answered with `status` and {"detail": message}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


PREFIX_BYTES = 4096


async def read_body(request, limit: int, check_prefix=None) -> bytes:
    """The body, or a 413 as soon as it is over `limit` bytes (by its header or as it streams in). `check_prefix`
    sees its first PREFIX_BYTES (or all of a shorter body) before the rest is read, and may refuse it (raise)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise HttpError(413, f"request body of {size} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"request body over the limit of {limit} bytes")
        if check_prefix is not None and len(body) >= PREFIX_BYTES:
            check_prefix(bytes(body[:PREFIX_BYTES]))
            check_prefix = None
    if check_prefix is not None:
        check_prefix(bytes(body))
    return bytes(body)


async def read_json(request, limit: int) -> dict:
    """The body as a JSON object (an empty body is {}); a 400 otherwise."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise HttpError(400, f"the body is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HttpError(400, "the body must be a JSON object")
    return data


@functools.cache
def tls_context():
    """One TLS context for every HTTP client of the process, with httpx's defaults (certifi's roots, or
    SSL_CERT_FILE / SSL_CERT_DIR). httpx builds a context per client by reading the whole CA bundle, ~20 ms of
    CPU; the clients that live for one request (an episode's event loop is short-lived) spent more on that than
    on the request itself. An `ssl.SSLContext` may be shared by clients on any thread or loop. (`astuner_remote`,
    installable without astuner, keeps the same three lines.)"""
    import httpx

    return httpx.create_ssl_context()
