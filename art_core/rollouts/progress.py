"""The rich progress bar of a gather: rollouts done, the running mean reward, the exception count.

Used by `rollouts.groups`; rich is imported only when a bar is shown.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager


class GatherProgress:
    """A rich progress bar on stderr: rollouts done, running mean reward, exception count."""

    def __init__(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.description = description
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.task = self.bar.add_task(description, total=0)
        self.exceptions = 0
        self._reward_sum = 0.0
        self._rewarded = 0

    @classmethod
    @contextmanager
    def open(cls, description: str, enabled: bool) -> Iterator[GatherProgress | None]:
        if not enabled:
            yield None
            return
        progress = cls(description)
        with progress.bar:
            yield progress

    def add_total(self, n: int) -> None:
        total = self.bar.tasks[0].total or 0
        self.bar.update(self.task, total=total + n)

    def advance(self, reward: float | None) -> None:
        """One rollout finished (reward None: it failed or is not scored yet)."""
        if reward is not None and math.isfinite(reward):
            self._reward_sum += reward
            self._rewarded += 1
        mean = f"{self._reward_sum / self._rewarded:.3f}" if self._rewarded else "-"
        self.bar.update(
            self.task,
            advance=1,
            description=f"{self.description} reward={mean} exceptions={self.exceptions}",
        )
