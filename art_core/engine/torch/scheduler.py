"""The torch engine's batching rules as plain data: what starts a batch, what joins one, and when.

`Scheduler.plan(queued, running, ...)` returns a `StepPlan` (as vLLM's `schedule()` returns its
output): with nothing running, how long to wait for the rest of a burst, then which queued rows
start the next batch (at most `max_batch_size`); with a lane running, which queued rows join it.
`Scheduler.lanes(rows, serving)` splits a batch into its lanes: the merged serving copy's rows
first, then the peft model's. `shared_prompt_length` says which rows prefill a common prefix once.
The rules: nothing starts while paused or closed; nothing joins while a pause, an adapter
operation or a re-merge waits, nor while rows of the other lane wait (so neither lane starves the
other), nor onto a serving copy whose weights went stale. Left out: running anything (the engine
does, `engine.py`) and the per-row decoding (`decoding.py`). Torch-free, so the rules are tested
without a model. See docs/architecture.md ("The torch engine").
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the scheduler reads of a row (`RowState` in the engine)."""

    @property
    def adapter(self) -> str | None: ...
    @property
    def cancelled(self) -> bool: ...


R = TypeVar("R", bound=Queued)


class Lane(StrEnum):
    """Where a row decodes."""

    SERVING = "serving"
    """The merged serving copy: the served adapter's rows, no peft code, the prefix cache."""
    PEFT = "peft"
    """The peft model itself, with per-row adapters: every other row."""


@dataclass(frozen=True)
class Serving:
    """The merged serving copy, as the scheduler sees it."""

    adapter: str | None
    """The adapter merged into it (None: the base model)."""
    stale: bool = False
    """The model's weights changed since the copy was merged (a train step without a pause)."""


@dataclass(frozen=True)
class Gate:
    """What holds the engine's worker back."""

    paused: bool = False
    """`pause()` holds the model for a trainer: nothing starts or joins until `resume()`."""
    closed: bool = False
    """`close()` was called, or the worker died."""
    ops_waiting: bool = False
    """An adapter operation waits for the running batch to end."""
    resync_due: bool = False
    """A full re-merge of the serving copy waits for the running batch to end."""

    @property
    def joins_blocked(self) -> bool:
        return self.paused or self.closed or self.ops_waiting or self.resync_due


@dataclass(frozen=True)
class StepPlan(Generic[R]):
    """One decision of the scheduler; the default plan does nothing."""

    wait_s: float = 0.0
    """> 0: wait this long for more of a burst (or a wake-up), then plan again."""
    start: tuple[R, ...] = ()
    """Rows that start the next batch (split into lanes by `Scheduler.lanes` once the serving
    copy is up to date)."""
    join: tuple[R, ...] = ()
    """Rows that join the running lane now."""
    queue: tuple[R, ...] | None = None
    """The queue after this step (cancelled rows dropped where it was scanned); None: unchanged."""


@dataclass(frozen=True)
class LanePlan(Generic[R]):
    """One lane of a batch: its rows, whether queued rows may join it, whether it uses the prefix cache."""

    lane: Lane
    """Where the rows decode."""
    rows: tuple[R, ...]
    """The rows the lane starts with."""
    joinable: bool
    """Queued rows of this lane may join while it runs (not while the other lane waits its turn)."""
    prefix_cache: bool
    """The serving copy's weights change only when it is re-merged, so its lane may reuse cached
    prefixes; the peft model's adapters change under it at any time."""


@dataclass(frozen=True)
class Scheduler:
    """The batching rules (see the module docstring); `EngineConfig` gives the numbers."""

    max_batch_size: int = 32
    """Most rows a batch starts with (and holds, joiners included)."""
    batch_wait_s: float = 0.005
    """A new batch waits until no request arrived for this long..."""
    batch_wait_max_s: float = 0.05
    """...but at most this long after the worker began waiting."""

    def plan(
        self,
        queued: Sequence[R],
        running: Lane | None,
        *,
        gate: Gate = Gate(),
        now: float = 0.0,
        arrived: float = 0.0,
        since: float = 0.0,
        serving: Serving | None = None,
        room: int = 0,
    ) -> StepPlan[R]:
        """The next step: start a batch (`running` None) or let rows join the running lane.

        `now`, `arrived` (when rows were last queued) and `since` (when the worker began waiting)
        are monotonic seconds, read only to start a batch; `serving` and `room` (free rows in the
        running batch) only to join one.
        """
        if running is None:
            return self._start(queued, gate, now, arrived, since)
        return self._join(queued, running, gate, serving, room)

    def _start(
        self, queued: Sequence[R], gate: Gate, now: float, arrived: float, since: float
    ) -> StepPlan[R]:
        if gate.closed or gate.paused:
            return StepPlan()
        if queued and len(queued) < self.max_batch_size:
            left = min(arrived + self.batch_wait_s, since + self.batch_wait_max_s) - now
            if left > 0:
                return StepPlan(wait_s=left)
        taken: list[R] = []
        scanned = 0
        for row in queued:
            if len(taken) >= self.max_batch_size:
                break
            scanned += 1
            if not row.cancelled:
                taken.append(row)
        return StepPlan(start=tuple(taken), queue=tuple(itertools.islice(queued, scanned, None)))

    def _join(
        self, queued: Sequence[R], running: Lane, gate: Gate, serving: Serving | None, room: int
    ) -> StepPlan[R]:
        if not queued or gate.joins_blocked or room <= 0:
            return StepPlan()
        if running is Lane.SERVING and serving is not None and serving.stale:
            return StepPlan()  # the batch's rows finish on their weights; the queue waits for a re-merge
        live = [row for row in queued if not row.cancelled]
        mine = [row for row in live if lane_of(row, serving) is running]
        if len(mine) < len(live):  # the other lane waits: both start the next batch
            return StepPlan(queue=tuple(live))
        return StepPlan(join=tuple(mine[:room]), queue=tuple(mine[room:]))

    @staticmethod
    def lanes(rows: Sequence[R], serving: Serving | None) -> tuple[LanePlan[R], ...]:
        """`rows` (one batch) by lane, in the order they run: the serving copy's, then the peft model's."""
        fast = tuple(row for row in rows if lane_of(row, serving) is Lane.SERVING)
        slow = tuple(row for row in rows if lane_of(row, serving) is Lane.PEFT)
        plans = []
        if fast:
            plans.append(LanePlan(Lane.SERVING, fast, joinable=not slow, prefix_cache=True))
        if slow:
            plans.append(LanePlan(Lane.PEFT, slow, joinable=True, prefix_cache=False))
        return tuple(plans)


def lane_of(row: Queued, serving: Serving | None) -> Lane:
    """The serving copy's lane for the served adapter's rows (when there is a copy), else peft's."""
    return Lane.SERVING if serving is not None and row.adapter == serving.adapter else Lane.PEFT


MIN_SHARED_PROMPT = 16
"""Shortest common prompt prefix (tokens) that `DecodeBatch.prefill` runs once for all rows."""


class Prompted(Protocol):
    """What `shared_prompt_length` reads of a row."""

    @property
    def adapter(self) -> str | None: ...
    @property
    def prompt_ids(self) -> list[int]: ...


def shared_prompt_length(rows: Sequence[Prompted], minimum: int = MIN_SHARED_PROMPT) -> int:
    """Leading prompt tokens common to all `rows` (at least 2, all of one adapter), leaving each
    row at least one token of its own; 0 when that is below `minimum`."""
    if len(rows) < 2 or len({r.adapter for r in rows}) != 1:
        return 0
    common = len(os.path.commonprefix([r.prompt_ids for r in rows]))
    common = min(common, min(len(r.prompt_ids) for r in rows) - 1)
    return common if common >= max(minimum, 1) else 0


__all__ = [
    "MIN_SHARED_PROMPT",
    "Gate",
    "Lane",
    "LanePlan",
    "Queued",
    "Scheduler",
    "Serving",
    "StepPlan",
    "lane_of",
    "shared_prompt_length",
]
