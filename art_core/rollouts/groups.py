"""Groups of rollouts and running them: `TrajectoryGroup`, and the gather with an exception budget.

`TrajectoryGroup` is a record (trajectories, exceptions, metrics) and a container of pending
rollouts whose `await` runs this module's gather, so it lives here, beside the gather.

`gather_trajectory_groups` mirrors ART's function of the same name:
- every pending rollout of every group runs concurrently (at most `max_concurrency` at once);
- a rollout that raises, or returns something that is not a `Trajectory`, is kept in its group's
  `exceptions` as an `ExceptionInfo` (type, message, full traceback);
- when the failures exceed `max_exceptions`, the remaining work is cancelled and awaited (nothing
  is left pending) and a `GatherError` is raised from the first failure;
- `after_each` runs on each group as soon as its rollouts are done (e.g. RULER scoring) and may
  return the group, a list of groups, or None to drop it (logged at warning level and counted).

Order: groups come back in input order (a group that `after_each` splits gives its pieces in
place). Inside a group, trajectories that were already finished come first, then the pending
rollouts' results in the order they were given (not completion order), so a run is reproducible.

Left out from ART: `max_metrics`, the contextvar-based `GatherContext`, `trajectory_group_batches`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from art_core.rollouts.progress import GatherProgress
from art_core.rollouts.records import ExceptionInfo, Trajectory

logger = logging.getLogger(__name__)


def _sequence(value: Any) -> bool:
    """Whether `value` is a collection of items (not text, bytes or a mapping, which pydantic refuses
    as a list with the field's name)."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario, compared with each other by GRPO.

    Built from finished trajectories, or from awaitables of them: then `await group` (or
    `gather_trajectory_groups`) runs them and keeps failures in `exceptions`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[ExceptionInfo] = Field(default_factory=list)
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    pending: SkipJsonSchema[list[Awaitable[Trajectory]]] = Field(
        default_factory=list, exclude=True, repr=False
    )

    def __init__(
        self,
        trajectories: Iterable[Trajectory | dict[str, Any] | Awaitable[Trajectory]] = (),
        **kwargs: Any,
    ) -> None:
        pending: Any = kwargs.pop("pending", [])
        if _sequence(pending):
            pending = list(pending)
        if _sequence(trajectories) and isinstance(pending, list):
            items = list(trajectories)
            pending += [item for item in items if inspect.isawaitable(item)]
            trajectories = [item for item in items if not inspect.isawaitable(item)]
        # Everything else, a dict or a value that is no trajectory at all (JSON from a client), is
        # validated by the fields, so an error names its place: `trajectories.<i>.<field>`.
        super().__init__(trajectories=trajectories, pending=pending, **kwargs)

    def __await__(self):  # type: ignore[no-untyped-def]
        async def run() -> TrajectoryGroup:
            groups = await gather_trajectory_groups([self], pbar=False)
            return groups[0]

        return run().__await__()

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[no-untyped-def, override]
        return iter(self.trajectories)


AfterEach = Callable[
    [TrajectoryGroup],
    "Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None] | TrajectoryGroup | list[TrajectoryGroup] | None",
]
"""Called (async or not) with each finished group; returns it (possibly changed), a list of groups, or None to drop it."""


class GatherError(RuntimeError):
    """More rollouts failed than `max_exceptions` allows; the rest were cancelled."""

    def __init__(self, message: str, exceptions: list[ExceptionInfo]) -> None:
        super().__init__(message)
        self.exceptions = exceptions
        """Every failure recorded before the gather stopped, first one first."""


@dataclass(frozen=True)
class GatherStats:
    """What happened in one gather, beside the groups it returned."""

    trajectories: int
    """Trajectories that finished and were kept."""
    exceptions: int
    """Rollouts and `after_each` calls that failed (each kept in its group's `exceptions`)."""
    dropped_groups: int
    """Groups that `after_each` dropped by returning None."""
    seconds: float
    """Wall-clock time of the whole gather."""


class GatheredGroups(list[TrajectoryGroup]):
    """The list of groups `gather_trajectory_groups` returns, with its `stats` attached."""

    stats: GatherStats


_Handler = Callable[[int, int, Any, "BaseException | None"], None]
"""Handles a finished task: (slot index, rollout index, result, exception)."""


@dataclass
class _Slot:
    """One input group while it is being gathered."""

    group: TrajectoryGroup | None = None
    results: list[Trajectory | None] = field(default_factory=list)
    remaining: int = 0
    output: list[TrajectoryGroup] = field(default_factory=list)


@dataclass
class _Budget:
    """Counts failures and decides when there are too many."""

    max_exceptions: float
    total: int = 0
    """Trajectories known so far (finished or pending, in groups that have resolved)."""
    unresolved: int = 0
    """Input groups that are still awaitables; while any remain, `total` is only a lower bound."""
    failures: list[ExceptionInfo] = field(default_factory=list)
    first: BaseException | None = None

    def record(self, exc: BaseException) -> ExceptionInfo:
        info = ExceptionInfo.from_exception(exc)
        self.failures.append(info)
        if self.first is None:
            self.first = exc
        return info

    def exceeded(self) -> bool:
        n = len(self.failures)
        if 0 < self.max_exceptions < 1:
            # A fraction of a total that is still growing cannot be judged until every group resolved.
            return self.unresolved == 0 and n > self.max_exceptions * self.total
        return n > self.max_exceptions

    def error(self) -> GatherError:
        first = self.failures[0]
        limit = (
            f"{self.max_exceptions:.0%} of {self.total} trajectories"
            if 0 < self.max_exceptions < 1
            else f"{self.max_exceptions:g}"
        )
        return GatherError(
            f"{len(self.failures)} rollout(s) failed, more than max_exceptions allows ({limit}); "
            f"the remaining rollouts were cancelled. Raise max_exceptions to tolerate failures. "
            f"First failure:\n{first.traceback}",
            list(self.failures),
        )


def _check_max_exceptions(max_exceptions: float) -> float:
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float):
        raise TypeError(f"max_exceptions must be an int or a float, got {type(max_exceptions).__name__}")
    if math.isnan(max_exceptions) or max_exceptions < 0:
        raise ValueError(
            f"max_exceptions must be 0, a count >= 1, or a fraction in (0, 1); got {max_exceptions}"
        )
    return float(max_exceptions)


def _discard(awaitable: object) -> None:
    """Dispose of an awaitable that will never be awaited, without 'never awaited' warnings."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()
    elif isinstance(awaitable, asyncio.Future):
        awaitable.cancel()


async def _await_started(awaitable: object, semaphore: asyncio.Semaphore | None, what: str) -> Any:
    """Await `awaitable` once a semaphore slot is free; close it if cancelled before it started."""
    if not inspect.isawaitable(awaitable):
        raise TypeError(f"expected {what} or an awaitable of one, got {type(awaitable).__name__}")
    if semaphore is None:
        return await awaitable
    try:
        await semaphore.acquire()
    except BaseException:
        _discard(awaitable)
        raise
    try:
        return await awaitable
    finally:
        semaphore.release()


async def _call_after_each(after_each: AfterEach, group: TrajectoryGroup) -> Any:
    """Run `after_each` inside a task, so that even a synchronous failure is recorded."""
    result: Any = after_each(group)
    return await result if inspect.isawaitable(result) else result


def _as_groups(result: object) -> list[TrajectoryGroup] | None:
    """Normalise what `after_each` returned."""
    if result is None:
        return None
    if isinstance(result, TrajectoryGroup):
        return [result]
    if isinstance(result, list) and all(isinstance(g, TrajectoryGroup) for g in result):
        return result
    raise TypeError(
        "after_each must return a TrajectoryGroup, a list of TrajectoryGroup, or None; "
        f"got {type(result).__name__}"
    )


class _Gather:
    """The state of one `gather_trajectory_groups` call: slots, running tasks, budget, progress."""

    def __init__(
        self,
        inputs: list[TrajectoryGroup | Awaitable[TrajectoryGroup]],
        budget: _Budget,
        semaphore: asyncio.Semaphore | None,
        after_each: AfterEach | None,
        progress: GatherProgress | None,
    ) -> None:
        self.inputs = inputs
        self.slots = [_Slot() for _ in inputs]
        self.budget = budget
        self.semaphore = semaphore
        self.after_each = after_each
        self.progress = progress
        self.tasks: dict[asyncio.Future[Any], tuple[_Handler, int, int]] = {}
        self.dropped = 0

    def _spawn(self, awaitable: Awaitable[Any], handler: _Handler, slot: int, index: int = -1) -> None:
        task = asyncio.ensure_future(awaitable)
        self.tasks[task] = (handler, slot, index)

    def start(self) -> None:
        for i, item in enumerate(self.inputs):
            if isinstance(item, TrajectoryGroup):
                self._open(i, item)
            else:
                self.budget.unresolved += 1
                self._spawn(_await_started(item, None, "a TrajectoryGroup"), self._on_resolve, i)

    def _open(self, i: int, group: TrajectoryGroup) -> None:
        """Start the pending rollouts of a resolved group."""
        slot = self.slots[i]
        pending, group.pending = list(group.pending), []
        slot.group, slot.results, slot.remaining = group, [None] * len(pending), len(pending)
        self.budget.total += len(group.trajectories) + len(pending)
        if self.progress is not None:
            self.progress.add_total(len(pending))
        for j, awaitable in enumerate(pending):
            self._spawn(_await_started(awaitable, self.semaphore, "a Trajectory"), self._on_rollout, i, j)
        if not pending:
            self._close(i)

    def _close(self, i: int) -> None:
        """All rollouts of slot i are done: assemble the group and hand it to `after_each`.

        A group left with no trajectories (every rollout failed) skips `after_each` and is
        returned as it is, holding its exceptions.
        """
        slot = self.slots[i]
        assert slot.group is not None
        slot.group.trajectories.extend(t for t in slot.results if t is not None)
        slot.group.metrics["exceptions"] = len(slot.group.exceptions)
        if self.after_each is None or not slot.group.trajectories:
            slot.output = [slot.group]
        else:
            self._spawn(_call_after_each(self.after_each, slot.group), self._on_after_each, i)

    def _fail(self, i: int, exc: BaseException, where: str) -> None:
        slot = self.slots[i]
        info = self.budget.record(exc)
        assert slot.group is not None
        slot.group.exceptions.append(info)
        slot.group.metrics["exceptions"] = len(slot.group.exceptions)
        logger.warning("%s of group %d failed: %s: %s", where, i, info.type, info.message)
        if self.progress is not None:
            self.progress.exceptions = len(self.budget.failures)

    def handle(self, task: asyncio.Future[Any]) -> None:
        handler, i, j = self.tasks.pop(task)
        exc: BaseException | None = (
            asyncio.CancelledError("cancelled from outside the gather")
            if task.cancelled()
            else task.exception()
        )
        handler(i, j, None if exc is not None else task.result(), exc)

    def _on_resolve(self, i: int, _j: int, result: Any, exc: BaseException | None) -> None:
        self.budget.unresolved -= 1
        if exc is None and not isinstance(result, TrajectoryGroup):
            exc = TypeError(f"group {i} resolved to {type(result).__name__}, not a TrajectoryGroup")
        if exc is not None:
            # An awaitable group that failed becomes an empty group holding the exception.
            self.slots[i].group = TrajectoryGroup()
            self._fail(i, exc, "building")
            self._close(i)
            return
        self._open(i, result)

    def _on_rollout(self, i: int, j: int, result: Any, exc: BaseException | None) -> None:
        slot = self.slots[i]
        if exc is None and not isinstance(result, Trajectory):
            exc = TypeError(
                f"rollout {j} of group {i} returned {type(result).__name__}, not a Trajectory; "
                "a rollout function must return an art_core.Trajectory"
            )
        if exc is not None:
            self._fail(i, exc, f"rollout {j}")
        else:
            slot.results[j] = result
        if self.progress is not None:
            self.progress.advance(result.reward if exc is None else None)
        slot.remaining -= 1
        if slot.remaining == 0:
            self._close(i)

    def _on_after_each(self, i: int, _j: int, result: Any, exc: BaseException | None) -> None:
        slot = self.slots[i]
        assert slot.group is not None
        if exc is None:
            try:
                groups = _as_groups(result)
            except TypeError as error:
                exc = error
        if exc is not None:
            # Kept unchanged (e.g. unscored) with the failure recorded; the trainer decides.
            self._fail(i, exc, "after_each")
            slot.group.metrics["after_each_errors"] = 1
            slot.output = [slot.group]
        elif groups is None:
            self.dropped += 1
            logger.warning(
                "after_each dropped group %d (%d trajectories) by returning None",
                i,
                len(slot.group.trajectories),
            )
        else:
            slot.output = groups

    async def run(self) -> list[TrajectoryGroup]:
        self.start()
        try:
            while self.tasks:
                done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self.handle(task)
                if self.budget.exceeded():
                    raise self.budget.error() from self.budget.first
        finally:
            await self.cancel_all()
        return [g for slot in self.slots for g in slot.output]

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait for them, so nothing is left pending."""
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str = "gather",
    pbar: bool = True,
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Run every pending rollout of every group and return the finished groups, in input order.

    Args:
        groups: `TrajectoryGroup`s (usually built from rollout coroutines) or awaitables that
            resolve to one; a group whose awaitable fails becomes an empty group holding the error.
        pbar_desc: label of the progress bar.
        pbar: show a rich progress bar on stderr with the running mean reward and exception count.
        max_exceptions: failures tolerated: 0 raises on the first, a count >= 1, or a fraction in
            (0, 1) of all trajectories (judged once every awaitable group has resolved).
        max_concurrency: most rollouts running at once across all groups; None for no limit.
        after_each: called with each group as soon as its rollouts finished; returns the group,
            a list of groups, or None to drop it. Its failures count against `max_exceptions`.

    Returns:
        A `GatheredGroups` list (a plain list with `.stats: GatherStats`).

    Raises:
        GatherError: more failures than `max_exceptions`; the remaining rollouts were cancelled.
    """
    budget = _Budget(_check_max_exceptions(max_exceptions))
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be None or >= 1, got {max_concurrency}")
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    started = time.perf_counter()
    with GatherProgress.open(pbar_desc, enabled=pbar) as progress:
        gather = _Gather(list(groups), budget, semaphore, after_each, progress)
        result = GatheredGroups(await gather.run())
    result.stats = GatherStats(
        trajectories=sum(len(g.trajectories) for g in result),
        exceptions=len(budget.failures),
        dropped_groups=gather.dropped,
        seconds=time.perf_counter() - started,
    )
    logger.info(
        "gathered %d groups, %d trajectories, %d exceptions, %d dropped groups in %.1fs",
        len(result),
        result.stats.trajectories,
        result.stats.exceptions,
        result.stats.dropped_groups,
        result.stats.seconds,
    )
    return result


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str = "gather",
    pbar: bool = True,
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
) -> list[Trajectory]:
    """Run rollouts that do not form groups; returns the ones that succeeded, in input order.

    Failures within `max_exceptions` are logged at warning level and left out of the result.
    """
    groups = await gather_trajectory_groups(
        [TrajectoryGroup(trajectories)],
        pbar_desc=pbar_desc,
        pbar=pbar,
        max_exceptions=max_exceptions,
        max_concurrency=max_concurrency,
    )
    return list(groups[0].trajectories)
