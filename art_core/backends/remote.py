"""`RemoteBackend`: train and serve on an `art serve` process, over HTTP.

```python
backend = RemoteBackend("http://gpu-box:7999", api_key=os.environ["ART_API_KEY"])
await model.register(backend)          # loads the model on the server (may take minutes)
client = model.openai_client()         # talks to the server's /v1 directly
await model.train(groups, on_progress=lambda phase, metrics: print(phase))
```

The routes are described in `art_core.host.routes`. This module imports neither the server
nor the trainer, so a client process does not load transformers.

Retries: each train request carries an idempotency key (`request_key`). If the connection breaks
mid-step (the server was killed, restarted, or the network dropped), `train` waits for the server's
`/health` (up to `retry_wait_s`), registers the model again if the server lost it, and resends the
same request: a step the server had already committed is answered from its checkpoint, never
trained twice; one it had not is trained. After `train_retries` failed retries it raises
`RemoteUnavailableError` saying so.

Timeouts: one long, configurable timeout (default an hour) per read, so registering a big
model or a long training step never fails at an arbitrary short limit (ART #281); the train
stream sends heartbeats, so that limit measures silence, not the whole step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

import httpx
from pydantic_core import to_jsonable_python

from art_core.backends.art_compat import ArtBackendMixin, log_result, resolve_train_config
from art_core.host.records import (
    WIRE_PREFIX,
    InferenceInfo,
    ModelRef,
    ModelSpec,
    ProgressCallback,
    TrainResult,
    model_name,
)
from art_core.rollouts.groups import TrajectoryGroup
from art_core.storage import StorageFullError
from art_core.training.config import TrainConfig

logger = logging.getLogger(__name__)

PREFIX = WIRE_PREFIX
DEFAULT_TIMEOUT_S = 3600.0
NO_KEY = "no-key"
"""The API key handed to OpenAI clients when the server needs none (the client insists on one)."""


class RemoteError(RuntimeError):
    """The server answered with an error (OpenAI's JSON error shape); `status` is its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


class RemoteBadRequestError(RemoteError):
    """400: the request was wrong (a bad config, a missing or non-finite reward, a bad name)."""


class RemoteAuthenticationError(RemoteError):
    """401: the API key is missing or wrong."""


class RemoteNotFoundError(RemoteError):
    """404: no such model is registered on the server."""


class RemoteRequestTooLargeError(RemoteError):
    """413: the request body is over the server's limit (`art serve --max-body-mib`); send fewer
    trajectories per `train` call, or raise the server's limit."""


class RemoteStorageFullError(RemoteError, StorageFullError):
    """507: the server's disk filled while it committed the step. The step was not committed, the
    server rolled back to its previous checkpoint, and a retry trains the step again once there is
    room. It is a `StorageFullError` too, so one `except` serves a local and a remote backend."""


class RemoteUnavailableError(RemoteError, ConnectionError):
    """No HTTP answer: the server is unreachable or the connection broke (`status` is 0)."""


_BY_STATUS: dict[int, type[RemoteError]] = {
    400: RemoteBadRequestError,
    401: RemoteAuthenticationError,
    404: RemoteNotFoundError,
    413: RemoteRequestTooLargeError,
    507: RemoteStorageFullError,
}


def remote_error(status: int, body: Any) -> RemoteError:
    """The typed exception for an error body (`{"error": {...}}`, or anything else)."""
    error = body.get("error") if isinstance(body, dict) else None
    cls = _BY_STATUS.get(status, RemoteError)
    if not isinstance(error, dict):
        return cls(status, str(body) or "no error message")
    return cls(
        status,
        str(error.get("message") or "no error message"),
        type=error.get("type"),
        code=error.get("code"),
        param=error.get("param"),
    )


def _error_of(response: httpx.Response) -> RemoteError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return remote_error(response.status_code, body)


def encode_train_request(
    groups: Sequence[TrajectoryGroup], config: TrainConfig, request_key: str | None = None
) -> bytes:
    """The JSON body of a train request. Non-finite floats stay `NaN`/`Infinity` (so the server
    can reject a non-finite reward by name instead of seeing it as missing)."""
    payload: dict[str, Any] = {
        "groups": [group.model_dump(mode="python") for group in groups],
        "config": dataclasses.asdict(config),
    }
    if request_key is not None:
        payload["request_key"] = request_key
    return json.dumps(payload, default=to_jsonable_python).encode()


def normalize_base_url(base_url: str) -> str:
    """`http://host:port` from what a user may pass (a trailing `/` or `/v1`)."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


class RemoteBackend(ArtBackendMixin):
    """The `Backend` of an `art serve` process: everything `LocalBackend` does, over HTTP.

    `api_key` defaults to `$ART_API_KEY`; `timeout` (seconds, None for none) bounds each wait
    for the server, including registration, which can take minutes for a big model.
    `train_retries`: how often a train request whose connection broke is resent (same idempotency
    key) once the server answers `/health` again within `retry_wait_s`; 0 to fail at once.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout: float = 30.0,
        train_retries: int = 2,
        retry_wait_s: float = 600.0,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds (or None for no limit), got {timeout}")
        if train_retries < 0 or retry_wait_s < 0:
            raise ValueError(
                f"train_retries and retry_wait_s must be >= 0, got {train_retries} and {retry_wait_s}"
            )
        self.train_retries, self.retry_wait_s = train_retries, retry_wait_s
        self._specs: dict[str, ModelSpec] = {}
        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get("ART_API_KEY")
        connect = connect_timeout if timeout is None else min(connect_timeout, timeout)
        self._timeout = httpx.Timeout(timeout, connect=connect)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r})"

    def _http(self) -> httpx.AsyncClient:
        """The HTTP client of the running event loop (a new one if the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self._timeout)
            self._loop = loop
        return self._client

    def _unavailable(self, exc: httpx.TransportError, doing: str) -> RemoteUnavailableError:
        return RemoteUnavailableError(
            0,
            f"could not {doing} at {self.base_url}: {type(exc).__name__}: {exc or 'no details'} "
            "(is `art serve` running there, and is the URL right?)",
        )

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http().request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unavailable(exc, f"{method} {path}") from exc
        if response.status_code >= 400:
            raise _error_of(response)
        return response.json()

    @staticmethod
    def _path(model: ModelRef, tail: str = "") -> str:
        return f"{PREFIX}/{quote(model_name(model), safe='')}{tail}"

    async def register(self, spec: ModelSpec) -> InferenceInfo:
        data = await self._call("POST", PREFIX, json=spec.model_dump(mode="json"))
        self._specs[spec.name] = spec
        return InferenceInfo(
            base_url=data["base_url"], api_key=self.api_key or NO_KEY, model_name=data["model_name"]
        )

    async def train(
        self,
        model: ModelRef,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
        **art_kwargs: Any,
    ) -> TrainResult:
        """One step on the server; `on_progress` is called for each progress line it streams.

        If `on_progress` raises, the stream is dropped but the server still finishes the step.
        ART 0.5's `train(model, groups, learning_rate=...)` works too (see `art_core.training.art_args`).
        """
        resolved, verbose = resolve_train_config(config, art_kwargs, where="RemoteBackend.train")
        result = await self._train(model, groups, resolved, on_progress)
        if config is None:
            log_result(result, verbose)
        return result

    async def _train(
        self,
        model: ModelRef,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        on_progress: ProgressCallback | None,
    ) -> TrainResult:
        body = encode_train_request(list(groups), config, request_key=uuid.uuid4().hex)
        for attempt in range(self.train_retries + 1):
            try:
                return await self._train_once(model, body, on_progress)
            except RemoteUnavailableError as exc:
                if attempt == self.train_retries:
                    raise RemoteUnavailableError(
                        0,
                        f"{exc.message}; gave up after {self.train_retries} retries of this train request. "
                        "The step may have been applied: check `await model.get_step()` before training again",
                    ) from exc
                logger.warning("train request to %s broke (%s); retrying once the server is back", self, exc)
                await self._wait_until_back()
        raise AssertionError("unreachable")

    async def _train_once(
        self, model: ModelRef, body: bytes, on_progress: ProgressCallback | None
    ) -> TrainResult:
        headers = {"Content-Type": "application/json"}
        try:
            async with self._http().stream(
                "POST", self._path(model, "/train"), content=body, headers=headers
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_of(response)
                async for line in response.aiter_lines():
                    result = _handle_line(line, on_progress)
                    if result is not None:
                        return result
        except httpx.TransportError as exc:
            raise self._unavailable(exc, "finish the training stream") from exc
        raise RemoteUnavailableError(
            0,
            "the server closed the training stream without a result or an error; the step may "
            "still have completed there: check `await model.get_step()`",
        )

    async def _wait_until_back(self) -> None:
        """Wait for `/health`, then register again every model this backend registered (a restarted
        server has none; registering resumes each from its newest checkpoint)."""
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            try:
                if (await self._http().get("/health", timeout=5.0)).is_success:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RemoteUnavailableError(
                    0, f"{self.base_url} did not answer /health again within {self.retry_wait_s} s"
                )
            await asyncio.sleep(0.5)
        for spec in self._specs.values():
            await self._call("POST", PREFIX, json=spec.model_dump(mode="json"))

    async def get_step(self, model: ModelRef) -> int:
        return int((await self._call("GET", self._path(model, "/step")))["step"])

    async def list_checkpoints(self, model: ModelRef) -> list[int]:
        return [int(s) for s in (await self._call("GET", self._path(model, "/checkpoints")))["steps"]]

    async def delete_checkpoints(self, model: ModelRef, keep: Iterable[int]) -> list[int]:
        params = {"keep": [int(step) for step in keep]}
        data = await self._call("DELETE", self._path(model, "/checkpoints"), params=params)
        return [int(s) for s in data["deleted"]]

    async def history(self, model: ModelRef) -> list[dict[str, float]]:
        return list((await self._call("GET", self._path(model, "/history")))["history"])

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()
        self._loop = None

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _handle_line(line: str, on_progress: ProgressCallback | None) -> TrainResult | None:
    """Act on one NDJSON line of a train stream: the result, None to go on, or raise the error."""
    if not line.strip():
        return None
    event = json.loads(line)
    if "result" in event:
        return TrainResult.model_validate(event["result"])
    if "error" in event:
        raise remote_error(int(event.get("status", 500)), event)
    if "phase" in event and on_progress is not None:
        on_progress(str(event["phase"]), dict(event.get("metrics") or {}))
    return None  # heartbeats and unknown lines


__all__ = [
    "RemoteAuthenticationError",
    "RemoteBackend",
    "RemoteBadRequestError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteRequestTooLargeError",
    "RemoteStorageFullError",
    "RemoteUnavailableError",
    "encode_train_request",
    "normalize_base_url",
    "remote_error",
]
