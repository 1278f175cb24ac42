"""Who gets into the server: the API key check (401) and the bound on requests in flight (503).

Both answer at once in OpenAI's error shape (`art_core.server.errors`). The engines' own bound
(`EngineConfig.max_queued_rows`, HTTP 429) is what clients normally meet; `ConcurrencyLimit`
keeps the process's memory and sockets bounded whatever the route (docs/architecture.md,
"Bounded under load").
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from art_core.server.errors import UNAVAILABLE_RETRY_AFTER_S, APIError

MAX_CONCURRENT_REQUESTS = 4096
"""Default bound on HTTP requests in flight (`create_app`); past it the server answers 503. Above the
engine's default `max_queued_rows` (2048), so a client normally meets the engine's 429 first."""


def _authorized(request: Request, api_key: str) -> bool:
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def require_api_key(app: FastAPI, api_key: str) -> None:
    """Every route of `app` needs `Authorization: Bearer <api_key>`; else 401 `invalid_api_key`."""

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if not _authorized(request, api_key):
            return APIError(401, "Incorrect API key provided", code="invalid_api_key").response()
        return await call_next(request)


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


__all__ = ["MAX_CONCURRENT_REQUESTS", "ConcurrencyLimit", "require_api_key"]
