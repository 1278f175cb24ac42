"""What a sink receives (`StepRecord`) and what it is (`StepSink`); see `host.sinks` for the runner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from art_core.rollouts.groups import TrajectoryGroup


@dataclass(frozen=True)
class StepRecord:
    """One step as the sinks see it, after history.jsonl has it."""

    project: str
    """The model's project."""
    model: str
    """The model's name."""
    step: int
    """Our step (W&B's step too)."""
    split: str
    """`train`, or the split `model.log` recorded (e.g. `val`)."""
    metrics: Mapping[str, Any]
    """The history line as written."""
    groups: Sequence[TrajectoryGroup] = ()
    """The step's trajectory groups."""


class StepSink(Protocol):
    """A destination for step records; `record` runs on the runner's thread, never concurrently."""

    name: str

    def record(self, step: StepRecord) -> None: ...

    def close(self) -> None: ...
