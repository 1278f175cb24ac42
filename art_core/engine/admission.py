"""Admission control: how many rows an engine holds, and when a refused client should retry.

`TorchEngine.generate` counts a request's n rows from admission until it returns (queued,
decoding, or waiting while the engine is paused for training). A request that would take the
count past `EngineConfig.max_queued_rows` is refused at once with `EngineOverloadedError`,
carrying `retry_after_s`: the time the rows beyond capacity need to finish at the recent decoding
rate (rows per second of batch time, an exponential average), clamped to 1-60 s (1 s before the
first batch). So a flood gets fast refusals (HTTP 429), never an unbounded wait or queue.

`Admission` keeps the count and the rate; `RateWindow` measures the rate over a running batch.
"""

from __future__ import annotations

import math
import time

from art_core.engine.errors import EngineOverloadedError


class Admission:
    """The rows admitted to an engine and its recent decoding rate (behind Retry-After).

    Not locked on its own: the engine calls `admit` and `release` and reads `rows` holding its
    lock; `note_rate` runs on the engine's worker thread.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        """`EngineConfig.max_queued_rows`."""
        self.rows = 0
        """Rows of requests whose generate() has not returned (queued, decoding, or paused)."""
        self._row_rate = 0.0  # recent rows finished per second of decoding

    def admit(self, n: int) -> None:
        """Count `n` rows against `max_rows`; EngineOverloadedError if they do not fit."""
        capacity = self.max_rows
        if self.rows + n > capacity:
            raise EngineOverloadedError(
                f"the engine is full: {self.rows} rows (completions) are queued or decoding, "
                f"this request adds {n} and EngineConfig.max_queued_rows is {capacity}; retry after "
                "Retry-After seconds, send fewer requests at once, or raise max_queued_rows",
                retry_after_s=self.retry_after(self.rows + n - capacity),
            )
        self.rows += n

    def release(self, n: int) -> None:
        """Stop counting `n` admitted rows (their request returned, failed or was cancelled)."""
        self.rows -= n

    def retry_after(self, excess_rows: int) -> int:
        """Seconds until `excess_rows` more rows have finished at the recent decoding rate, in [1, 60].

        1 s before any batch was timed. The rate is that of decoding: a pause for training is not
        foreseen, and a client told to retry during one may be told again.
        """
        if self._row_rate <= 0:
            return 1
        return max(1, min(60, math.ceil(excess_rows / self._row_rate)))

    def note_rate(self, rows: int, seconds: float) -> None:
        """Fold one batch's rows per second into the running rate (exponential average)."""
        rate = rows / max(seconds, 1e-3)
        self._row_rate = rate if self._row_rate <= 0 else 0.7 * self._row_rate + 0.3 * rate


class RateWindow:
    """Rows finished over a span of decoding time (what `Admission.note_rate` is fed)."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self.finished = 0
        """Rows finished since the window started (the decoding rate behind Retry-After)."""

    def seconds(self) -> float:
        return time.monotonic() - self._start

    def count(self, rows: int) -> None:
        self.finished += rows

    def take(self) -> tuple[int, float]:
        """(rows finished, seconds) of the window so far, and start a new one."""
        now = time.monotonic()
        window = (self.finished, now - self._start)
        self._start, self.finished = now, 0
        return window
