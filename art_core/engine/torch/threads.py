"""How many threads the torch engine decodes with, chosen by measuring its own steps.

A decode step is hundreds of small torch ops, each an OpenMP parallel region that ends at a
barrier: with N threads, every op waits for the slowest of them. On a machine the engine has to
itself that pays (2 threads ~1.6-1.9x one on SmolLM2 at 32 rows). When other processes share the
cores (the agent's code, MCP tool servers, a judge, the trainer: always, in agent RL) one of the
N threads is descheduled for a time slice now and then, and every barrier it owes stalls the
whole step; measured on a 2-core machine under other work, 2 threads were many times slower
than one (docs/benchmarks.md, "When the engine does not have the machine to itself").

So the engine does not fix its thread count. `ThreadTuner` keeps the decode loop at the count
that is fastest now: it explores each candidate (1, and torch's thread count) for a
few steps, keeps the one with the lowest median step time, and explores again after a while or
as soon as steps get much slower than they were when it chose (the load changed). Step times are
compared only at the same batch size. It is data and arithmetic; the engine applies its choice
with `torch.set_num_threads` on the decoding thread (`apply`). Left out: OpenMP's wait policy and
binding, which the runtime reads from the environment when it loads (`art_core.engine.openmp`
sets a short spin count for our entry points; docs/benchmarks.md).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass
class ThreadTuner:
    """Picks the decode loop's thread count from its measured step times (see the module docstring)."""

    candidates: tuple[int, ...]
    """Thread counts to choose from, ascending."""
    trial_steps: int = 4
    """Steps timed per candidate when exploring (the first of them is not counted: it warms up)."""
    hold_steps: int = 256
    """Steps run at the chosen count before exploring again."""
    slowdown: float = 1.5
    """Explore again at once when the median of recent steps exceeds the chosen median by this factor."""
    current: int = 0
    """The thread count in force (the first candidate's at start)."""
    _trial: dict[int, list[float]] = field(default_factory=dict)
    _exploring: list[int] = field(default_factory=list)
    _held: int = 0
    _chosen_s: float = 0.0
    _recent: list[float] = field(default_factory=list)
    _rows: int = -1

    def __post_init__(self) -> None:
        if not self.candidates or min(self.candidates) < 1:
            raise ValueError(f"candidates must be thread counts >= 1, got {self.candidates}")
        if self.trial_steps < 2 or self.hold_steps < 1 or self.slowdown <= 1:
            raise ValueError("trial_steps must be >= 2, hold_steps >= 1 and slowdown > 1")
        self.candidates = tuple(sorted(set(self.candidates)))
        self._explore()

    @classmethod
    def for_machine(cls) -> ThreadTuner:
        """Candidates 1 and torch's thread count (OMP_NUM_THREADS, `torch.set_num_threads`, else the
        cores), at most the usable CPUs; a single candidate (nothing to tune) where that is 1."""
        return cls(candidates=(1, min(torch.get_num_threads(), usable_cpus())))

    @property
    def exploring(self) -> bool:
        return bool(self._exploring)

    def _explore(self) -> None:
        self._exploring = list(reversed(self.candidates))  # the most threads first: the quiet-machine pick
        self._trial = {}
        self.current = self._exploring[0]

    def record(self, rows: int, seconds: float) -> int:
        """Note one decode step of `rows` rows that took `seconds` at `current` threads; returns
        the thread count for the next step."""
        if len(self.candidates) == 1:
            return self.current
        if self._exploring:
            if rows != self._rows:  # another batch size: the trials so far are not comparable
                self._rows = rows
                self._explore()
                return self.current
            times = self._trial.setdefault(self.current, [])
            times.append(seconds)
            if len(times) >= self.trial_steps:
                self._exploring.pop(0)
                if self._exploring:
                    self.current = self._exploring[0]
                else:
                    medians = {n: statistics.median(t[1:]) for n, t in self._trial.items()}
                    self.current = min(medians, key=lambda n: (medians[n], n))
                    self._chosen_s, self._held, self._recent = medians[self.current], 0, []
            return self.current
        self._held += 1
        slow = False
        if rows == self._rows:  # the slowdown check compares like with like only
            self._recent = [*self._recent[-7:], seconds]
            slow = len(self._recent) == 8 and statistics.median(self._recent) > self.slowdown * self._chosen_s
        if self._held >= self.hold_steps or slow:
            self._explore()
        return self.current


def apply(threads: int) -> None:
    """Use `threads` intra-op threads on this thread from now on (no-op when already so)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def apply_thread_policy() -> ThreadTuner:
    """The tuner the engine's decoding thread uses, its first choice applied."""
    tuner = ThreadTuner.for_machine()
    apply(tuner.current)
    return tuner
