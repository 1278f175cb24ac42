"""The rollout scope: every LLM call to our server inside it becomes part of one `Trajectory`.

```python
async with rollout(model) as scope:          # or decorate:  @rollout_scope(model)
    client = model.openai_client()            # tagged with the scope's id automatically
    ...                                       # LiteLLM: **model.litellm_completion_params()
    scope.reward = 1.0                        # any language / plain HTTP: scope.base_url
trajectory = scope.trajectory                 # messages, tools, exact token turns, reward
```

Entering gives the rollout an id and makes it the active rollout (capture's one contextvar, which
also holds the scope, so concurrent rollouts in separate tasks never see each other's id). Requests
to the rollout's own server carry the id as the
`X-Rollout-Id` header (`model.openai_client()`, `model.sync_openai_client()`,
`integrations.openai.patch_client(client)`, `integrations.litellm.scoped_params(params)`), or in
the URL (`scope.base_url`, and `model.litellm_completion_params()` called inside the scope).
The server records the exact tokens under that id. On exit the scope fetches and frees the
records over HTTP (never an in-process shortcut, so a remote server works the same) and builds
the trajectory. Nothing captured is an error (`NothingCapturedError`), never an empty trajectory.
A rollout that raises still frees its records, then the exception propagates.

Blocking code (`graph.invoke`, a thread) uses `with rollout(model) as scope:` the same way; the
exit then fetches with blocking httpx. `async with` and `with` share one enter and one exit.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import Token
from typing import TYPE_CHECKING, Any, ParamSpec, Self

import httpx

from art_core.capture import (
    ROLLOUT_ID_HEADER,
    ActiveRollout,
    CallRecord,
    RolloutRecords,
    active_rollout,
    histories_from_records,
    message_key,
    reset_active_rollout,
    rollout_base_url,
    server_root,
    set_active_rollout,
    trajectory_from_records,
    validate_rollout_id,
)
from art_core.types import Trajectory

if TYPE_CHECKING:
    from art_core.model import TrainableModel

logger = logging.getLogger(__name__)

P = ParamSpec("P")


class NothingCapturedError(RuntimeError):
    """A rollout scope ended without a single LLM call recorded by our server."""


class CaptureFetchError(RuntimeError):
    """The server did not return a rollout's records."""


def current_scope() -> RolloutScope | None:
    """The innermost rollout scope of the current context, or None."""
    active = active_rollout()
    return active.scope if active is not None else None


class RolloutScope:
    """One rollout: an id, the URL and headers that capture into it, and the trajectory at exit."""

    def __init__(
        self, model: TrainableModel, *, rollout_id: str | None = None, fetch_timeout: float = 60.0
    ) -> None:
        self.model = model
        self.id = validate_rollout_id(rollout_id) if rollout_id is not None else uuid.uuid4().hex
        self.server_url = server_root(model.inference_base_url)
        self.fetch_timeout = fetch_timeout
        self.reward: float | None = None
        """Set it inside the scope; the trajectory gets it on exit."""
        self.metrics: dict[str, float | int | bool] = {}
        """Copied into the trajectory's metrics on exit."""
        self.metadata: dict[str, str | int | float | bool | None] = {}
        """Copied into the trajectory's metadata on exit (beside `rollout_id`)."""
        self.logs: list[str] = []
        """Copied into the trajectory's logs on exit (e.g. the MCP door's tool-call lines)."""
        self.records: list[CallRecord] = []
        """What the server recorded, once the scope has exited."""
        self.started = time.time()
        """When the rollout began (entering the scope): the trajectory's `start_time`."""
        self._trajectory: Trajectory | None = None
        self._build_on_exit = True
        self._token: Token[ActiveRollout | None] | None = None

    @property
    def base_url(self) -> str:
        """The rollout-scoped OpenAI base URL, `<server>/rollouts/<id>/v1`: any client pointed here is captured."""
        return rollout_base_url(self.model.inference_base_url, self.id)

    @property
    def headers(self) -> dict[str, str]:
        """`{"X-Rollout-Id": id}`: add to requests sent to the plain `/v1` URL to capture them."""
        return {ROLLOUT_ID_HEADER: self.id}

    @property
    def trajectory(self) -> Trajectory:
        """The captured trajectory; available once the scope has exited without an exception."""
        if self._trajectory is None:
            raise RuntimeError(
                f"rollout {self.id}: the trajectory is built when the scope exits; read it after the `async with`"
            )
        return self._trajectory

    def __enter__(self) -> Self:
        """Enter a `with` block: for blocking code (`graph.invoke`); the exit fetches with blocking httpx."""
        if self._token is not None:
            raise RuntimeError("a RolloutScope can be entered only once; make a new one per rollout")
        self._token = set_active_rollout(ActiveRollout(self.id, self.server_url, scope=self))
        self.started = time.time()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._leave()
        try:
            fetched: list[CallRecord] | Exception = self.fetch_records_sync()
        except Exception as fetch_exc:
            fetched = fetch_exc
        self._finish(exc, fetched)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        self._leave()
        try:
            fetched: list[CallRecord] | Exception = await self.fetch_records()
        except Exception as fetch_exc:
            fetched = fetch_exc
        self._finish(exc, fetched)

    def _leave(self) -> None:
        """The rollout is no longer the active one (before its records are fetched)."""
        assert self._token is not None, "exit without enter"
        reset_active_rollout(self._token)

    def _finish(self, exc: BaseException | None, fetched: list[CallRecord] | Exception) -> None:
        """The end of an exit, given what the fetch returned or raised.

        A rollout that raised only needed its records freed: its own exception is what matters, so a
        failed fetch is logged. Otherwise a failed fetch raises; the records are kept and, unless a
        decorator builds it from what the rollout returned, the trajectory is built.
        """
        if exc is not None:
            if isinstance(fetched, Exception):
                logger.warning("rollout %s failed and its records could not be freed: %s", self.id, fetched)
            return
        if isinstance(fetched, Exception):
            raise fetched
        self.records = fetched
        if self._build_on_exit:
            self._trajectory = self.build(None)

    async def fetch_records(self) -> list[CallRecord]:
        """Fetch the rollout's records from the server and free them there (`DELETE /rollouts/<id>`)."""
        try:
            async with httpx.AsyncClient(timeout=self.fetch_timeout) as http:
                response = await http.delete(self._records_url, headers=self._auth)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return self._records_in(response)

    def fetch_records_sync(self) -> list[CallRecord]:
        """`fetch_records` with blocking httpx."""
        try:
            with httpx.Client(timeout=self.fetch_timeout) as http:
                response = http.delete(self._records_url, headers=self._auth)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return self._records_in(response)

    @property
    def _records_url(self) -> str:
        return f"{self.server_url}/rollouts/{self.id}"

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.model.inference_api_key}"}

    def _unreachable(self, exc: httpx.HTTPError) -> CaptureFetchError:
        return CaptureFetchError(
            f"could not fetch the records of rollout {self.id} from {self._records_url}: {exc}"
        )

    def _records_in(self, response: httpx.Response) -> list[CallRecord]:
        if response.status_code != 200:
            raise CaptureFetchError(
                f"the server answered {response.status_code} for the records of rollout {self.id} "
                f"({self._records_url}): {response.text[:500]}"
            )
        # json.loads, not pydantic's JSON parser: the server writes a lone surrogate that a client
        # sent (as a \ud800 escape) back as the same escape, which pydantic's parser refuses.
        return RolloutRecords.model_validate(json.loads(response.content)).records

    def build(self, returned: Trajectory | None) -> Trajectory:
        """The trajectory from the fetched records, merged into `returned` when the rollout returned one."""
        fields: dict[str, Any] = {
            "reward": self.reward,
            "metrics": dict(self.metrics),
            "metadata": {"rollout_id": self.id, **self.metadata},
            "logs": list(self.logs),
            "start_time": self.started,
        }
        if returned is None:
            if not self.records:
                raise NothingCapturedError(self._nothing_captured_message())
            return trajectory_from_records(self.records, **fields)
        return self._merge(returned, fields)

    def _merge(self, returned: Trajectory, fields: dict[str, Any]) -> Trajectory:
        """Add the captured records to a trajectory the rollout built itself.

        A trajectory that already has token turns (built from our choices by hand) keeps them and
        its messages; otherwise it gets the captured turns, tools and additional histories, and the
        captured conversation unless its own messages extend it (e.g. a final tool result).
        """
        if returned.reward is None:
            returned.reward = fields["reward"]
        returned.metrics = {**fields["metrics"], **returned.metrics}
        returned.metadata = {**fields["metadata"], **returned.metadata}
        returned.logs = [*fields["logs"], *returned.logs]
        returned.start_time = min(returned.start_time, fields["start_time"])  # often built after the calls
        if returned.turns:
            return returned
        if not self.records:
            raise NothingCapturedError(self._nothing_captured_message())
        main, *others = histories_from_records(self.records)
        own = [message_key(m) for m in returned.messages]
        if own[: len(main.messages)] != [message_key(m) for m in main.messages]:
            returned.messages = main.messages
        returned.turns = main.turns
        returned.tools = returned.tools if returned.tools is not None else main.tools
        returned.additional_histories = [*returned.additional_histories, *others]
        return returned

    def _nothing_captured_message(self) -> str:
        return (
            f"rollout {self.id}: no LLM call reached {self.server_url} inside the rollout scope, so there is "
            "nothing to train on. Likely causes: the client is not pointed at the trained model (use "
            "`model.openai_client()`, `model.sync_openai_client()`, `**model.litellm_completion_params()` "
            "called inside the scope, or any client with base_url=scope.base_url); a client of your own is "
            "pointed at the server without the rollout header (wrap it with "
            "`integrations.openai.patch_client(client)` or pass `extra_headers=scope.headers`); or the calls "
            "ran outside the scope (a task or thread started before it, `loop.run_in_executor`, which does not "
            "copy the context - use `asyncio.to_thread`)"
        )


def rollout(
    model: TrainableModel, *, rollout_id: str | None = None, fetch_timeout: float = 60.0
) -> RolloutScope:
    """A rollout scope for `async with`; `scope.trajectory` holds the result after the block."""
    return RolloutScope(model, rollout_id=rollout_id, fetch_timeout=fetch_timeout)


def rollout_scope(
    model: TrainableModel,
) -> Callable[[Callable[P, Awaitable[Any]]], Callable[P, Awaitable[Trajectory]]]:
    """Decorate an async rollout function so that each call runs in its own scope and returns a Trajectory.

    The function may return a reward (a number), None (the reward, if any, set on
    `current_scope().reward`) or a `Trajectory`, to which the captured records are added.
    """

    def decorate(fn: Callable[P, Awaitable[Any]]) -> Callable[P, Awaitable[Trajectory]]:
        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> Trajectory:
            scope = rollout(model)
            scope._build_on_exit = False  # the trajectory depends on what fn returns
            async with scope:
                result = await fn(*args, **kwargs)
            scope._trajectory = scope.build(_returned_trajectory(scope, result, fn))
            return scope._trajectory

        return run

    return decorate


def _returned_trajectory(scope: RolloutScope, result: Any, fn: Callable[..., Any]) -> Trajectory | None:
    """Apply what a decorated rollout returned: a reward, None, or its own Trajectory."""
    if isinstance(result, Trajectory):
        return result
    if isinstance(result, bool) or not (result is None or isinstance(result, int | float)):
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)} returned {type(result).__name__}; a function decorated "
            "with @rollout_scope returns a reward (a number), None, or a Trajectory"
        )
    if result is not None:
        scope.reward = float(result)
    return None


__all__ = [
    "CaptureFetchError",
    "NothingCapturedError",
    "RolloutScope",
    "current_scope",
    "rollout",
    "rollout_scope",
]
