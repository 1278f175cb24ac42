"""A fixed, reproducible background load: one process that alternates compute and sleep.

What shares the cores with an inference engine in agent RL (a tool server answering calls, a
judge, the agent's own code) is bursty: it computes for tens of milliseconds, then waits. This
process does that at normal priority, single-threaded: it busy-computes for about `compute_ms`
of its own CPU time (the same work however busy the machine is), then sleeps for about
`sleep_ms`, each period's lengths drawn from a seeded generator (uniform in +-`jitter` of the nominal), so two runs with the same seed load the machine alike. Benchmarks
start it around their measured rounds (`serve_throughput.py --contention`, `thread_policy.py`)
and end it by its process group. It prints one JSON line when it stops (SIGTERM/SIGINT): the
periods it ran and the CPU seconds it used.

    python bench/background_load.py [--compute-ms 50] [--sleep-ms 50] [--seed 0] [--jitter 0.2]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class LoadShape:
    """The background load's rhythm."""

    compute_ms: float = 50.0
    """Busy computing per period (nominal)."""
    sleep_ms: float = 50.0
    """Asleep per period (nominal)."""
    seed: int = 0
    """Seeds the per-period lengths."""
    jitter: float = 0.2
    """Each length is drawn uniformly within +- this fraction of its nominal."""

    def __post_init__(self) -> None:
        if self.compute_ms <= 0 or self.sleep_ms < 0:
            raise ValueError("compute_ms must be > 0 and sleep_ms >= 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def argv(self) -> list[str]:
        """The command line that runs this load (`start`)."""
        return [
            sys.executable, str(SCRIPT), "--compute-ms", str(self.compute_ms), "--sleep-ms",
            str(self.sleep_ms), "--seed", str(self.seed), "--jitter", str(self.jitter),
        ]  # fmt: skip

    def describe(self) -> str:
        return (
            f"1 process, normal priority: {self.compute_ms:g} ms compute / {self.sleep_ms:g} ms sleep "
            f"(+-{self.jitter:.0%}, seed {self.seed})"
        )


def start(shape: LoadShape, log: Path | None = None) -> subprocess.Popen[bytes]:
    """The load as a child process in its own process group (end it with `processes.stop_group`)."""
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(shape.argv(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _busy(seconds: float) -> int:
    """Integer arithmetic for `seconds` of this process's CPU time (so the work is the same however
    busy the machine is); returns the iterations done."""
    end = time.process_time() + seconds
    n, x = 0, 1
    while time.process_time() < end:
        for _ in range(200):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        n += 1
    return n


def run(shape: LoadShape) -> None:
    rng = random.Random(shape.seed)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    periods, started = 0, time.perf_counter()
    while not stop:
        spread = lambda nominal: nominal * rng.uniform(1 - shape.jitter, 1 + shape.jitter)  # noqa: E731
        _busy(spread(shape.compute_ms) / 1e3)
        time.sleep(spread(shape.sleep_ms) / 1e3)
        periods += 1
    print(json.dumps({"periods": periods, "wall_s": round(time.perf_counter() - started, 1),
                      "cpu_s": round(time.process_time(), 1)}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=0.2)
    args = parser.parse_args()
    run(LoadShape(args.compute_ms, args.sleep_ms, args.seed, args.jitter))


if __name__ == "__main__":
    main()
