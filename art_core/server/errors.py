"""HTTP errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is what the server's code raises; the handlers `install_error_handlers` adds turn it,
FastAPI's validation errors, Starlette's HTTP errors and unexpected exceptions into that shape.
`http_error` is the one exception-to-status ladder, for the OpenAI routes (`engine_error`, what an
engine raises) and the training routes of `host.routes` alike: a prompt that does not fit 400, an
unknown model or adapter 404, a full engine 429 and a closed one, or a replica that died under a
stream, 503 (both with `Retry-After`), anything else 500.
`JSONResponse` writes text that is not valid Unicode as `\\u` escapes instead of failing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _PlainJSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from art_core.engine.errors import (
    ContextLengthError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    ReplicaDownError,
    UnknownAdapterError,
)
from art_core.models.loading import ModelNotFoundError
from art_core.server.router import UnknownModelError
from art_core.storage import StorageFullError

logger = logging.getLogger(__name__)
T = TypeVar("T")

UNAVAILABLE_RETRY_AFTER_S = 1
"""`Retry-After` of a 503 (requests in flight at the limit, or the engine closed): a slot frees as
soon as any request ends, so a short fixed wait; a client retries it with its own backoff."""


class JSONResponse(_PlainJSONResponse):
    """Starlette's JSONResponse, except that text which is not valid Unicode (a lone surrogate that a
    client sent as a `\\ud800` escape, echoed in an error or a rollout record) is written as a JSON
    `\\u` escape instead of failing the response with a UnicodeEncodeError (a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})
        """Extra response headers (`Retry-After` on 429 and 503, `Allow` on 405)."""

    def body(self) -> dict[str, Any]:
        """The `error` object (also what a stream sends when it fails midway)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


class RequestTooLargeError(StarletteHTTPException):
    """A request body over the server's limit (`middleware.BodySizeLimit`), raised while it is read.

    An HTTPException, because FastAPI passes those through while it reads a body (any other error
    there becomes a generic 400); the error handlers answer it with `error` (413 `request_too_large`).
    """

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


async def engine_call(call: Awaitable[T]) -> T:
    """Await an engine call; its errors become APIErrors (`engine_error`)."""
    try:
        return await call
    except Exception as exc:
        raise engine_error(exc) from exc


def http_error(
    exc: BaseException, *, doing: str = "generation", bad_values_are_400: bool = False
) -> APIError:
    """The HTTP error (OpenAI shape) for an exception raised while serving a request: the one ladder.

    A prompt that does not fit 400; an unknown model or adapter 404; an unknown base model 400; a full
    engine 429 and a closed one (or a replica that died under a stream: `replica_down`) 503 (both with
    `Retry-After`); a step that found its disk full 507 (`storage_full`); an invalid request 400; with
    `bad_values_are_400` (the training routes: configs and rewards are checked by raising ValueError)
    any ValueError 400; anything else 500, logged as `doing` failing.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, UnknownAdapterError | UnknownModelError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ModelNotFoundError):
        return APIError(400, str(exc), param="base_model", code="model_not_found")
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, ReplicaDownError):  # one replica of several: the server is up, send it again
        return APIError(
            503,
            str(exc),
            type="server_error",
            code="replica_down",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    if isinstance(exc, EngineClosedError):
        return APIError(
            503,
            f"the engine is not running (is the server shutting down?): {exc}",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    if isinstance(exc, StorageFullError):  # the step was not committed; the previous checkpoint is intact
        return APIError(507, str(exc), type="server_error", code="storage_full")
    if isinstance(exc, InvalidRequestError) or (bad_values_are_400 and isinstance(exc, ValueError)):
        return APIError(400, str(exc))
    logger.error("%s failed", doing, exc_info=exc)
    return APIError(500, f"{doing} failed: {type(exc).__name__}: {exc}", type="server_error")


def engine_error(exc: Exception) -> APIError:
    """The HTTP error for an exception an engine raised (`http_error`)."""
    return http_error(exc, doing="generation")


SHOWN_VALIDATION_PROBLEMS = 3
"""How many of a request's validation problems a 400 spells out (the rest are counted)."""


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 for pydantic's validation `errors` of a request: each problem as `field.path: message`
    (`groups.0.trajectories.1.reward: Input should be a valid number`; the leading `body` dropped),
    the first few in the message, the first one's path as `param`."""
    problems, first_path = [], None
    for error in errors:
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "json_invalid":  # its loc is ("body", offset): say so, not "123: ..."
            offset = ".".join(str(part) for part in error.get("loc", ())[1:])
            path, message = "body", f"invalid JSON at character {offset}: {error.get('ctx', {}).get('error')}"
        else:
            path = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
        first_path = first_path or path
        problems.append(f"{path}: {message}")
    if not problems:
        return APIError(400, "invalid request")
    message = "; ".join(problems[:SHOWN_VALIDATION_PROBLEMS])
    if len(problems) > SHOWN_VALIDATION_PROBLEMS:
        message += f" (and {len(problems) - SHOWN_VALIDATION_PROBLEMS} more problems)"
    return APIError(400, message, param=None if first_path == "body" else first_path)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape (a validation error is a 400, not FastAPI's 422)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, RequestTooLargeError):
            return exc.error.response()
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug: still a 500 in OpenAI's shape (Starlette re-raises it afterwards, so it is logged).
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return APIError(500, message, type="server_error").response()


__all__ = [
    "SHOWN_VALIDATION_PROBLEMS",
    "UNAVAILABLE_RETRY_AFTER_S",
    "APIError",
    "JSONResponse",
    "RequestTooLargeError",
    "engine_call",
    "engine_error",
    "http_error",
    "install_error_handlers",
    "validation_error",
]
