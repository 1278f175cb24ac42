"""The training routes of `art serve`: what a `RemoteBackend` calls, beside the OpenAI routes.

| route                                        | body / query                       | answer                          |
|----------------------------------------------|------------------------------------|---------------------------------|
| `POST   /v1/art/models`                      | `ModelSpec` JSON                   | `RegisterResponse`              |
| `POST   /v1/art/models/{name}/train`         | `{"groups": [...], "config": {}}`  | NDJSON progress stream          |
| `GET    /v1/art/models/{name}/step`          |                                    | `{"step": n}`                   |
| `GET    /v1/art/models/{name}/checkpoints`   |                                    | `{"steps": [...]}`              |
| `DELETE /v1/art/models/{name}/checkpoints`   | `?keep=1&keep=3`                   | `{"deleted": [...]}`            |
| `GET    /v1/art/models/{name}/history`       |                                    | `{"history": [{...}, ...]}`     |

`config` is `dataclasses.asdict(TrainConfig(...))`; omitted fields take their defaults, unknown
ones are a 400. The train stream sends one JSON object per line: `{"phase": ..., "metrics": {...}}`
for each progress call, `{"heartbeat": seconds}` while a step is silent for a while (so idle
timeouts of proxies and clients measure silence, not the step), then exactly one final line:
`{"result": TrainResult}` or `{"error": {OpenAI error}, "status": http_status}`. A stream that ends
without one of those was cut off. Floats that are not finite are written as `NaN`/`Infinity`
(Python's `json`).

Errors found before training starts (unknown model 404; a bad config, a missing or non-finite
reward, no trainable tokens 400) are answered as plain HTTP errors in OpenAI's JSON shape, since
the stream starts only once the batch has been prepared. A body that does not validate is a 400
naming the field's path (`groups.0.trajectories.1.reward: ...`); a project or model name that is not
one safe path component (`..`, `/`, ...) is a 400 `invalid_name` before anything is looked up.
Authentication (401) and the body's size (413) are the app's: the middleware of `create_app`
covers these routes too (docs/reliability.md, "Abuse of the training routes").

No timeout is imposed here: registering a big model or training a long step takes as long as it
takes (ART #281 timed out at a hard-coded 10 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import typing
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from art_core.host.records import WIRE_PREFIX, ModelSpec, TrainResult
from art_core.host.service import ModelService
from art_core.rollouts.groups import TrajectoryGroup
from art_core.server.app import create_app
from art_core.server.errors import APIError, http_error
from art_core.server.middleware import MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS
from art_core.server.router import UnknownModelError
from art_core.storage import validate_name
from art_core.training.config import TrainConfig

logger = logging.getLogger(__name__)

PREFIX = WIRE_PREFIX
HEARTBEAT_S = 15.0
"""Seconds of silence in a train stream after which a heartbeat line is sent."""


class RegisterResponse(BaseModel):
    """Where the registered model is served, as the client reached this server."""

    base_url: str
    """OpenAI-compatible base URL (this server's URL + `/v1`)."""
    model_name: str
    """The served name of the latest weights."""
    step: int
    """The model's step (above 0 when it resumed from a checkpoint)."""


class TrainRequest(BaseModel):
    """The body of a train request."""

    groups: list[TrajectoryGroup]
    config: dict[str, Any] = Field(default_factory=dict)
    """`dataclasses.asdict(TrainConfig)`; missing fields take their defaults."""
    request_key: str | None = Field(default=None, min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """An idempotency key: a retry with the key of the request that committed the newest step gets
    that step's result again, and nothing trains twice (`ModelService.train`)."""


class StepResponse(BaseModel):
    step: int


class CheckpointsResponse(BaseModel):
    steps: list[int]


class DeletedResponse(BaseModel):
    deleted: list[int]


class HistoryResponse(BaseModel):
    history: list[dict[str, Any]]


# -- config and errors -----------------------------------------------------------------------------


def _unknown_fields(cls: type, data: dict[str, Any], where: str) -> list[str]:
    """Dotted names of keys in `data` that are not fields of dataclass `cls` (recursing into fields)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = []
    for key, value in data.items():
        if key not in known:
            unknown.append(f"{where}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            unknown.extend(_unknown_fields(typing.cast(type, hints[key]), value, f"{where}{key}."))
    return unknown


_TRAIN_CONFIG = TypeAdapter(TrainConfig)


def decode_train_config(data: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` of `dataclasses.asdict(config)`; APIError 400 with the reason otherwise."""
    unknown = _unknown_fields(TrainConfig, data, "")
    if unknown:
        known = sorted(f.name for f in dataclasses.fields(TrainConfig))
        raise APIError(400, f"unknown TrainConfig field(s) {unknown}; known fields: {known}", param="config")
    try:
        return _TRAIN_CONFIG.validate_python(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            loc = ".".join(str(part) for part in error["loc"])
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"{loc}: {message}" if loc else message)
        raise APIError(400, f"invalid train config: {'; '.join(problems)}", param="config") from None


def api_error(exc: BaseException) -> APIError:
    """The HTTP error (OpenAI shape) for an exception raised while serving a training route
    (`server.errors.http_error`; a ValueError there is the request's fault, a 400)."""
    return http_error(exc, doing="the training route", bad_values_are_400=True)


def checked_name(name: str, param: str) -> str:
    """`name` if it is safe as one path component (`storage.validate_name`: no `..`, `/`, `\\`, no
    leading `.`, 1-128 of letters, digits, `.`, `_`, `-`); else APIError 400 naming `param`.

    Every training route checks the names it is given before it looks anything up or builds a path.
    """
    try:
        return validate_name(name, param.replace("_", " "))
    except ValueError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_name") from None


def _check_registered(service: ModelService, name: str) -> None:
    checked_name(name, "name")
    try:
        service.get(name)
    except UnknownModelError:
        registered = sorted(n for n in service.model_names() if "@" not in n)
        raise APIError(
            404,
            f"no model named {name!r} is registered on this server (registered: {registered}); "
            "register it first (`await model.register(RemoteBackend(...))`)",
            param="model",
            code="model_not_found",
        ) from None


# -- the train stream ------------------------------------------------------------------------------


class TrainStream:
    """Runs one `ModelService.train` call as a task and turns its progress into NDJSON lines.

    The service calls `on_progress` from its worker thread; events cross into the event loop
    through `call_soon_threadsafe`, so the queue is only touched by the loop.
    """

    _running: set[asyncio.Task[TrainResult]] = set()
    """Tasks whose stream was dropped (client gone) still finish; this keeps them referenced."""

    def __init__(
        self,
        service: ModelService,
        name: str,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        request_key: str | None = None,
    ):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._started = time.monotonic()
        self.task = asyncio.create_task(
            service.train(
                name, groups, config, self._on_progress, request_key, background_commit=False
            )  # a remote client outlives a crash of this server: it is answered committed steps only
        )
        TrainStream._running.add(self.task)
        self.task.add_done_callback(self._finished)

    def _on_progress(self, phase: str, metrics: dict[str, float]) -> None:
        event = {"phase": phase, "metrics": {k: float(v) for k, v in metrics.items()}}
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def _finished(self, task: asyncio.Task[TrainResult]) -> None:
        TrainStream._running.discard(task)
        if task.cancelled():
            self._queue.put_nowait(
                RuntimeError("the training task was cancelled (is the server shutting down?)")
            )
        elif (exc := task.exception()) is not None:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait({"result": task.result().model_dump()})

    async def next_event(self) -> dict[str, Any] | BaseException:
        """The next progress event, final result or exception; a heartbeat after HEARTBEAT_S of silence."""
        try:
            return await asyncio.wait_for(self._queue.get(), HEARTBEAT_S)
        except TimeoutError:
            return {"heartbeat": round(time.monotonic() - self._started, 3)}

    async def lines(self, first: dict[str, Any]) -> AsyncIterator[bytes]:
        """NDJSON lines, from `first` to the final result or error line."""
        event: dict[str, Any] | BaseException = first
        while True:
            if isinstance(event, BaseException):
                error = api_error(event)
                yield _line({"error": error.body(), "status": error.status})
                return
            yield _line(event)
            if "result" in event:
                return
            event = await self.next_event()


def _line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event) + "\n").encode()


async def _start_training(
    service: ModelService, name: str, body: TrainRequest
) -> tuple[TrainStream, dict[str, Any]]:
    """Start training; return the stream and its first event, or raise the APIError of an early failure."""
    _check_registered(service, name)
    config = decode_train_config(body.config)
    stream = TrainStream(service, name, body.groups, config, body.request_key)
    while True:  # heartbeats here mean another step of this model holds its lock: keep waiting
        first = await stream.next_event()
        if isinstance(first, BaseException):
            raise api_error(first)
        if "heartbeat" not in first:
            return stream, first


# -- routes ----------------------------------------------------------------------------------------


def training_router(service: ModelService) -> APIRouter:
    """The training routes for `service` (mount them on an app made by `create_app`)."""
    router = APIRouter(prefix=PREFIX)

    @router.post("")
    async def register(spec: ModelSpec, request: Request) -> RegisterResponse:
        checked_name(spec.project, "project")
        checked_name(spec.name, "name")
        try:
            hosted = await asyncio.to_thread(service.register, spec)
        except Exception as exc:
            raise api_error(exc) from exc
        base_url = str(request.base_url).rstrip("/") + "/v1"
        return RegisterResponse(base_url=base_url, model_name=spec.name, step=hosted.step)

    @router.post("/{name}/train")
    async def train(name: str, body: TrainRequest) -> StreamingResponse:
        stream, first = await _start_training(service, name, body)
        return StreamingResponse(stream.lines(first), media_type="application/x-ndjson")

    @router.get("/{name}/step")
    async def step(name: str) -> StepResponse:
        _check_registered(service, name)
        return StepResponse(step=(await asyncio.to_thread(service.committed, name)).step)

    @router.get("/{name}/checkpoints")
    async def checkpoints(name: str) -> CheckpointsResponse:
        _check_registered(service, name)
        return CheckpointsResponse(steps=(await asyncio.to_thread(service.committed, name)).storage.steps())

    @router.delete("/{name}/checkpoints")
    async def delete_checkpoints(name: str, keep: list[int] = Query(default=[])) -> DeletedResponse:  # noqa: B008
        _check_registered(service, name)
        try:
            deleted = await asyncio.to_thread(service.delete_checkpoints, name, keep)
        except Exception as exc:
            raise api_error(exc) from exc
        return DeletedResponse(deleted=deleted)

    @router.get("/{name}/history")
    async def history(name: str) -> HistoryResponse:
        _check_registered(service, name)
        try:
            records = (await asyncio.to_thread(service.committed, name)).storage.read_history()
        except Exception as exc:
            raise api_error(exc) from exc
        return HistoryResponse(history=records)

    return router


def create_server_app(
    service: ModelService,
    *,
    api_key: str | None = None,
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The whole `art serve` app: OpenAI routes, training routes, and the API key on every route.

    Past `max_concurrent_requests` HTTP requests in flight (all routes but `/health`), others get 503;
    a request body over `max_body_bytes` gets 413.
    """
    app = create_app(
        service,
        api_key=api_key,
        max_concurrent_requests=max_concurrent_requests,
        max_body_bytes=max_body_bytes,
    )
    app.title = "art serve"
    app.include_router(training_router(service))
    return app


__all__ = [
    "PREFIX",
    "RegisterResponse",
    "TrainRequest",
    "TrainStream",
    "api_error",
    "checked_name",
    "create_server_app",
    "decode_train_config",
    "training_router",
]
