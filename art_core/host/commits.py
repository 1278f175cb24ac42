"""One model's commit in the background: the checkpoint of step n is written while step n+1's
rollouts run (the torch engine; `TorchServing.overlap_checkpoint`).

`BackgroundCommit` runs one commit at a time on its own thread and keeps what it raised. Whoever
must see the model's disk state settles first: `wait()` blocks until the commit in flight is done
(reads: the step, the checkpoints, the history); `settle()` also raises the commit's error, once
(the next train, close). The trainer's state is not copied: nothing changes it while it is saved,
since the next train settles before it trains, and serving only reads the weights.

Left out: what a commit does (`ModelService._commit`: `ModelStorage.commit_step`, the rollback on a
failure, the history line) and the synchronous path (vLLM, which loads the checkpoint from disk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class CommitInFlightError(RuntimeError):
    """A commit was handed over while the previous one was still running (settle first)."""


class BackgroundCommit:
    """At most one commit of one model in flight, on a (non-daemon) thread of its own.

    Non-daemon: an interpreter that exits without `close()` still finishes the write. A failure is
    logged at once and kept until a `settle()` raises it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def submit(self, step: int, commit: Callable[[], None]) -> None:
        """Run `commit` (step `step`'s write) on a new thread; CommitInFlightError if one still runs."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise CommitInFlightError(
                    f"{self.name}: a commit is still in flight; settle() before handing over step {step}"
                )
            if self._error is not None:
                raise CommitInFlightError(
                    f"{self.name}: the failed commit was not raised yet; settle() first"
                )
            thread = threading.Thread(
                target=self._run, args=(step, commit), name=f"commit-{self.name}-{step}", daemon=False
            )
            self._thread = thread
        thread.start()

    def _run(self, step: int, commit: Callable[[], None]) -> None:
        try:
            commit()
        except Exception as exc:
            with self._lock:
                self._error = exc
            logger.error(
                "the background commit of step %d of %s failed (%s: %s); the next train() or close() raises it",
                step,
                self.name,
                type(exc).__name__,
                exc,
            )

    def wait(self) -> float:
        """Block until no commit is in flight; the seconds it blocked (0.0 when none was)."""
        with self._lock:
            thread = self._thread
        if thread is None or not thread.is_alive():
            return 0.0
        started = time.perf_counter()
        thread.join()
        return time.perf_counter() - started

    def settle(self) -> float:
        """`wait()`, then raise the error of a commit that failed (once); the seconds it blocked."""
        waited = self.wait()
        with self._lock:
            error, self._error = self._error, None
            if self._thread is not None and not self._thread.is_alive():
                self._thread = None
        if error is not None:
            raise error
        return waited
