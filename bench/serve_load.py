"""What `load.py` and `soak.py` share: a real `art serve` subprocess, its memory and descriptors, a load.

`ArtServe` starts `python -m art_core.app.cli serve` on 127.0.0.1 (its own process group, so
`stop` ends it and any child) and registers one model on it through `RemoteBackend`, as a client
does. `ProcSample` reads the server's VmRSS, VmHWM (peak RSS) and open descriptors from
/proc/PID; `reset_peak` restarts VmHWM (`/proc/PID/clear_refs`, "5"), so a peak can be taken per
interval. `fire` sends chat requests at a fixed concurrency with httpx (no retries) and classifies
each answer (`Outcome`): 200 with a choice, an explicit overload refusal (429/503 with an integer
`Retry-After`), or anything else (another status, a refusal without `Retry-After`, a transport
error, a timeout). `slope` (least squares) and `percentile` are the pure arithmetic of the reports.
Linux only (/proc). Left out: what each bench does with these (`load.py`, `soak.py`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from processes import log_tail, stop_group, thread_env

from art_core.app import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
STARTUP_TIMEOUT_S = 300.0
PROJECT = "bench"
OVERLOAD_STATUSES = (429, 503)


# -- arithmetic -----------------------------------------------------------------------------------


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of `ys` against `xs` (0.0 with fewer than two distinct xs)."""
    if len(xs) != len(ys):
        raise ValueError(f"slope needs as many xs as ys, got {len(xs)} and {len(ys)}")
    n = len(xs)
    if n < 2:
        return 0.0
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-quantile (0..1) by linear interpolation between closest ranks; None when empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# -- the server's process -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    """One reading of a process's memory and descriptors."""

    rss_mb: float
    """VmRSS: resident memory now."""
    hwm_mb: float
    """VmHWM: the most resident memory since start (or since the last `reset_peak`)."""
    fds: int
    """Entries in /proc/PID/fd: open files, sockets and pipes."""


def sample(pid: int) -> ProcSample:
    """`pid`'s VmRSS, VmHWM and descriptor count, from /proc."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / MB
    return ProcSample(fields["VmRSS"], fields["VmHWM"], len(os.listdir(f"/proc/{pid}/fd")))


def reset_peak(pid: int) -> bool:
    """Restart `pid`'s VmHWM at its current RSS (`echo 5 > /proc/PID/clear_refs`); False where refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class ArtServe:
    """`art serve` in a subprocess on 127.0.0.1, with one registered model."""

    folder: Path
    """Its `--path` (checkpoints, history) and its log, `serve.log`."""
    extra_args: list[str] = field(default_factory=list)
    """More `art serve` flags, e.g. ["--max-queued-rows", "64"]."""
    threads: int = 1
    """OMP/MKL threads of the server (the load's client runs here, on the same cores)."""
    process: subprocess.Popen[bytes] | None = None
    url: str = ""
    backend: Any = None
    model: Any = None

    @property
    def log(self) -> Path:
        return self.folder / "serve.log"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the server has not been started")
        return self.process.pid

    def start(self) -> None:
        """Start the server and wait for /health (ServerStartError with its log's tail if it fails)."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "art_core.app.cli", "serve", "--port", str(port)]
        command += ["--path", str(self.folder / ".art"), "--log-level", "warning", *self.extra_args]
        env = thread_env(self.threads)
        env.pop("ART_API_KEY", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        wait_healthy(self.url, self.process, self.log, api_key=None, timeout_s=STARTUP_TIMEOUT_S)

    async def register(self, name: str, base_model: str) -> None:
        """Register `name` (a LoRA on `base_model`) as a client does; its chat name is `chat_model`."""
        from art_core.backends.remote import RemoteBackend
        from art_core.model import TrainableModel

        self.backend = RemoteBackend(self.url, retry_wait_s=0.0, train_retries=0)
        self.model = TrainableModel(project=PROJECT, name=name, base_model=base_model)
        await self.model.register(self.backend)

    @property
    def chat_url(self) -> str:
        return self.url + "/v1/chat/completions"

    @property
    def chat_model(self) -> str:
        return str(self.model.get_inference_name())

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()
            self.backend = None

    def stop(self) -> None:
        """End the server's process group (SIGINT, then harder); raises nothing."""
        if self.process is not None and self.process.poll() is None:
            stop_group(self.process)

    def alive_or_raise(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"art serve exited with {self.process.returncode}; its log ends:\n{log_tail(self.log)}"
            )


# -- the load -------------------------------------------------------------------------------------

OK, REJECTED, OTHER = "ok", "rejected", "other"


@dataclass(frozen=True)
class Outcome:
    """What one request got."""

    kind: str
    """OK (200 with a choice), REJECTED (429/503 with an integer Retry-After) or OTHER."""
    seconds: float
    """From sending to the whole answer read (or the error)."""
    detail: str = ""
    """For OTHER: the status and the start of the body, or the exception."""


def classify(status: int, headers: Any, body: Any) -> tuple[str, str]:
    """(kind, detail) of one HTTP answer; a refusal counts as explicit only with an integer Retry-After."""
    if status == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        if choices and isinstance(choices[0].get("message"), dict):
            return OK, ""
        return OTHER, f"200 without a choice: {str(body)[:200]}"
    if status in OVERLOAD_STATUSES:
        retry_after = headers.get("retry-after", "")
        if retry_after.isdigit() and int(retry_after) >= 1:
            return REJECTED, ""
        return OTHER, f"{status} without an integer Retry-After ({retry_after!r}): {str(body)[:200]}"
    return OTHER, f"{status}: {str(body)[:200]}"


def chat_body(model: str, index: int, max_tokens: int) -> dict[str, Any]:
    """Request `index`: a short different prompt, `max_tokens` tokens, seeded sampling."""
    content = f"Request {index}: name a fruit and say one thing about it."
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": index,
    }


async def fire(
    url: str,
    model: str,
    count: int,
    *,
    concurrency: int,
    max_tokens: int,
    timeout_s: float = 600.0,
    start: int = 0,
    on_done: Callable[[int, Outcome], None] | None = None,
    api_key: str | None = None,
) -> list[Outcome]:
    """Send requests `start`..`start + count - 1` to `url`, at most `concurrency` at once; one Outcome each.

    No retries: a refusal is recorded as it came. `on_done(i, outcome)` runs after each answer;
    `api_key` is sent as `Authorization: Bearer ...` when given.
    """
    import httpx

    if count < 0 or concurrency < 1:
        raise ValueError(f"count must be >= 0 and concurrency >= 1, got {count} and {concurrency}")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=timeout_s, pool=timeout_s)
    outcomes: list[Outcome | None] = [None] * count
    next_index = 0

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:

        async def one(i: int) -> Outcome:
            started = time.perf_counter()
            try:
                response = await client.post(url, json=chat_body(model, start + i, max_tokens))
                try:
                    body: Any = response.json()
                except ValueError:
                    body = response.text
                kind, detail = classify(response.status_code, response.headers, body)
            except httpx.HTTPError as exc:
                kind, detail = OTHER, f"{type(exc).__name__}: {exc}"
            return Outcome(kind, time.perf_counter() - started, detail)

        async def worker() -> None:
            nonlocal next_index
            while next_index < count:
                i = next_index
                next_index += 1
                outcome = await one(i)
                outcomes[i] = outcome
                if on_done is not None:
                    on_done(i, outcome)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return [o for o in outcomes if o is not None]


def tally(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by kind, latency p50/p99 (seconds, of every answer), and the first few OTHER details."""
    latencies = [o.seconds for o in outcomes]
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return {
        "requests": len(outcomes),
        "ok": sum(o.kind == OK for o in outcomes),
        "rejected_429_503": sum(o.kind == REJECTED for o in outcomes),
        "other_errors": sum(o.kind == OTHER for o in outcomes),
        "p50_s": None if p50 is None else round(p50, 3),
        "p99_s": None if p99 is None else round(p99, 3),
        "error_samples": sorted({o.detail for o in outcomes if o.kind == OTHER})[:5],
    }


async def wait_fds_settle(pid: int, at_most: int, timeout_s: float = 10.0) -> int:
    """`pid`'s descriptor count once it is <= `at_most`, or whatever it is after `timeout_s`
    (closed client connections take a moment to close on the server's side)."""
    deadline = time.monotonic() + timeout_s
    fds = sample(pid).fds
    while fds > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        fds = sample(pid).fds
    return fds
