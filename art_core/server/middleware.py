"""Who gets into the server: the API key check (401), the bound on requests in flight (503) and the
bound on a request body's size (413).

Each answers at once in OpenAI's error shape (`art_core.server.errors`). The engines' own bound
(`EngineConfig.max_queued_rows`, HTTP 429) is what clients normally meet; `ConcurrencyLimit`
keeps the process's memory and sockets bounded whatever the route (docs/architecture.md,
"Bounded under load").
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from art_core.server.errors import UNAVAILABLE_RETRY_AFTER_S, APIError, RequestTooLargeError

MAX_CONCURRENT_REQUESTS = 4096
"""Default bound on HTTP requests in flight (`create_app`); past it the server answers 503. Above the
engine's default `max_queued_rows` (2048), so a client normally meets the engine's 429 first."""


MAX_BODY_BYTES = 128 * 2**20
"""Default bound on a request body (`create_app`, `art serve --max-body-mib`): 128 MiB, room for a
train request of a few hundred trajectories of thousands of tokens each (ids and log-probs as JSON
text are some 25 bytes a token); past it the server answers 413 without reading the rest."""


def keys_match(given: str, expected: str) -> bool:
    """Whether `given` equals `expected`, in time independent of where they differ and of their lengths.

    Both are hashed (SHA-256) first and the digests compared with `hmac.compare_digest`: a plain
    `compare_digest` of the keys themselves returns at once when the lengths differ, which tells an
    attacker the key's length.
    """
    given_digest = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    expected_digest = hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(given_digest, expected_digest)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_api_key(app: FastAPI, api_key: str) -> None:
    """Every route of `app` needs `Authorization: Bearer <api_key>`; else 401 `invalid_api_key` with
    `WWW-Authenticate: Bearer`. The key is compared in constant time (`keys_match`)."""
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        given = request.headers.get("authorization")
        if given is None:
            return _unauthorized(
                "Missing API key: send the server's key as `Authorization: Bearer <key>`"
            ).response()
        if not keys_match(given, expected):
            return _unauthorized(
                "Incorrect API key provided: send the server's key as `Authorization: Bearer <key>`"
            ).response()
        return await call_next(request)


class BodySizeLimit:
    """ASGI middleware: a request body of more than `max_bytes` is answered 413 `request_too_large`.

    A declared `Content-Length` above the limit is refused before the app runs, without reading the
    body; a body without one (chunked) is counted as it arrives and refused once it passes the limit,
    by raising `RequestTooLargeError` from `receive` (an `HTTPException`, which FastAPI passes through
    while it reads a body, so the error handlers answer it; here, if they did not).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> RequestTooLargeError:
        return RequestTooLargeError(
            APIError(
                413,
                f"the request body is {size} bytes, over this server's limit of {self.max_bytes} bytes "
                "(max_body_bytes; `art serve --max-body-mib`): send fewer trajectories per request",
                code="request_too_large",
            )
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if (
            declared.isascii()
            and declared.isdigit()
            and (len(declared) > 18 or int(declared) > self.max_bytes)
        ):
            await self._too_large(declared).error.response()(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"more than {self.max_bytes}")
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except RequestTooLargeError as exc:  # raised where the app's error handlers did not answer it
            if started:
                raise
            await exc.error.response()(scope, receive, send)


class ConcurrencyLimit:
    """ASGI middleware: past `limit` HTTP requests in flight, answer 503 with `Retry-After` at once.

    A request counts from its start until its response (a streamed body included) has been sent.
    `/health` is exempt, so a prober sees a busy server as alive. The engines' own bound
    (`EngineConfig.max_queued_rows`, HTTP 429) is what clients normally meet; this one keeps the
    process's memory and sockets bounded whatever the route (training routes, many models).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {limit}")
        self.app, self.limit = app, limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = APIError(
                503,
                f"the server is busy: {self.in_flight} requests are in flight, its limit "
                "(max_concurrent_requests); retry after Retry-After seconds or send fewer at once",
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
            )
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


__all__ = [
    "MAX_BODY_BYTES",
    "MAX_CONCURRENT_REQUESTS",
    "BodySizeLimit",
    "ConcurrencyLimit",
    "keys_match",
    "require_api_key",
]
