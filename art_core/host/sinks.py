"""Where a step's record goes besides history.jsonl: W&B, Langfuse, anything with `record(step)`.

history.jsonl and the trajectories' JSONL are written first and stay the source of truth; sinks are
copies. `SinkRunner` hands each `StepRecord` to the sinks on one background thread through a
bounded queue, so a slow sink (a W&B table, an HTTP export) is off the step's critical path, and
a failing one never loses a metric: its exception is caught, logged once as a warning that says
what to do, counted (`errors`, which the next history line carries as `observe/<sink>_errors`),
and training goes on. `close()` drains the queue.

`ObserveConfig` chooses the sinks; each is on when its package is installed and its settings are
present (W&B: `WANDB_API_KEY` or `WANDB_MODE`; Langfuse: `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY`
and `LANGFUSE_HOST`), or when asked for explicitly.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from art_core.host.step_sink import StepRecord, StepSink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObserveConfig:
    """Which sinks a model's steps go to besides history.jsonl."""

    wandb: bool | None = None
    """True: log to W&B (a warning if wandb is missing); False: never; None: when wandb is installed
    and `WANDB_API_KEY` or `WANDB_MODE` is set."""
    langfuse: bool | None = None
    """True: export traces to Langfuse; False: never; None: when langfuse is installed and
    `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY` and `LANGFUSE_HOST` are set."""
    wandb_table_rows: int = 8
    """Sample trajectories per step in the W&B table (best and worst by reward, alternately)."""
    queue_size: int = 64
    """Steps waiting for the sinks before `submit` blocks (memory stays bounded)."""

    def __post_init__(self) -> None:
        if self.wandb_table_rows < 0:
            raise ValueError(f"wandb_table_rows must be >= 0, got {self.wandb_table_rows}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")

    def wants_wandb(self) -> bool:
        return _wanted(self.wandb, "wandb", ("WANDB_API_KEY", "WANDB_MODE"), any)

    def wants_langfuse(self) -> bool:
        keys = ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST")
        return _wanted(self.langfuse, "langfuse", keys, all)


def _wanted(flag: bool | None, package: str, env: Sequence[str], rule: Callable[[Any], bool]) -> bool:
    if flag is False:
        return False
    installed = find_spec(package) is not None
    if flag is True and not installed:
        logger.warning(
            "%s logging was asked for but %s is not installed: `pip install 'art-suite[%s]'`; "
            "history.jsonl still has every metric",
            package,
            package,
            package,
        )
        return False
    return installed and (flag is True or rule(os.environ.get(k) for k in env))


def build_sinks(config: ObserveConfig, model_dir: Path, project: str, model: str) -> list[StepSink]:
    """The sinks `config` turns on for one model; one that cannot start is a warning, not an error."""
    sinks: list[StepSink] = []
    if config.wants_wandb():
        from art_core.host.wandb_sink import WandbSink

        sinks.append(WandbSink(model_dir, project, model, table_rows=config.wandb_table_rows))
    if config.wants_langfuse():
        from art_core.host.langfuse_sink import LangfuseSink

        sinks.append(LangfuseSink())
    return sinks


_STOP = object()


@dataclass
class SinkRunner:
    """Runs sinks on one daemon thread from a bounded queue; counts and warns on their failures."""

    sinks: list[StepSink]
    queue_size: int = 64
    errors: dict[str, int] = field(default_factory=dict)
    """Failures per sink name so far."""

    def __post_init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(self.queue_size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, step: StepRecord) -> None:
        """Queue `step` for every sink (blocks only while the queue is full)."""
        if not self.sinks:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="art-sinks", daemon=True)
                self._thread.start()
        self._queue.put(step)

    def error_metrics(self) -> dict[str, float]:
        """`{"observe/<sink>_errors": n}` for each sink that failed (for the next history line)."""
        with self._lock:
            return {f"observe/{name}_errors": float(n) for name, n in self.errors.items()}

    def flush(self) -> None:
        """Wait until every queued step has reached the sinks."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Drain the queue, then close every sink (each failure counted, never raised)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        for sink in self.sinks:
            self._guard(sink, sink.close)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                for sink in self.sinks:
                    self._guard(sink, functools.partial(sink.record, item))
            finally:
                self._queue.task_done()

    def _guard(self, sink: StepSink, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # a sink is a copy: count it, warn once, go on
            with self._lock:
                count = self.errors[sink.name] = self.errors.get(sink.name, 0) + 1
            if count == 1:
                logger.warning(
                    "the %s sink failed (%s: %s); training goes on and history.jsonl keeps every metric. "
                    "Check its settings (see docs/observability.md) or turn it off with ObserveConfig(%s=False); "
                    "later failures are counted as observe/%s_errors",
                    sink.name,
                    type(exc).__name__,
                    exc,
                    sink.name,
                    sink.name,
                )
            else:
                logger.debug("the %s sink failed again", sink.name, exc_info=True)


__all__ = ["ObserveConfig", "SinkRunner", "StepRecord", "StepSink", "build_sinks"]
