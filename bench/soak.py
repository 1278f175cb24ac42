"""Soak a real `art serve` on 127.0.0.1: 300 train steps, then 20,000 requests (issue 18, soak).

    python bench/soak.py [--steps 300] [--requests 20000] [--concurrency 32] [--model tiny-random]
                         [--max-tokens 8] [--sample-every 500] [--train-warmup 0.1] [--serve-warmup 0.25]
                         [--prefix-cache-mib N]

One `art serve` process (tiny model by default, built locally: nothing is downloaded), one LoRA
model registered on it through `RemoteBackend`, then two phases, both measured on the server's
process from /proc/PID:

- **train**: `--steps` steps, each one group of 4 completions (n=4) from the server through the
  `openai` client, rewards 0, 1/3, 2/3, 1, and `model.train` (a checkpoint per step). Before each
  step the server's VmHWM is reset (`/proc/PID/clear_refs`), so the VmHWM read after it is that
  step's peak RSS. `train_rss_slope_mb_per_100_steps` is the least-squares slope of those peaks
  against the step, per 100 steps, over the steps after the first `--train-warmup` fraction
  (allocator warm-up); `train_rss_slope_all_mb_per_100_steps` is the same over every step.
- **serve**: `--requests` chat requests, `--concurrency` at once, no retries; every
  `--sample-every` requests the server's VmRSS and descriptors are read.
  `serve_rss_slope_mb_per_10k` is the least-squares slope of VmRSS against requests, per 10,000
  requests, past the first `--serve-warmup` fraction: the engine's prefix cache fills first (every
  prompt and completion is kept until its `--prefix-cache-mib` budget, 512 MiB by default, is
  reached, then the oldest are evicted), a bounded growth that is not a leak;
  `serve_rss_slope_all_mb_per_10k` is over every reading. `fd_start` is read before the load, `fd_end` after
  it, once the client's connections are closed (their server ends take a moment), `fd_max` is the
  most seen while it ran (the client's open connections included).

Flat means a slope near 0 against RSS in the hundreds of MB: a leak of 1 KB a request is
10 MB per 10k. The last line of stdout is one JSON object with those keys and `train_steps`,
`train_peak_first_mb`, `train_peak_last_mb`, `train_s`, `requests`, `ok`, `rejected_429_503`,
`other_errors`, `p50_s`, `p99_s`, `serve_rss_start_mb`, `serve_rss_end_mb`, `serve_rss_readings_mb` (every
`--sample-every` requests, from the start), `serve_s`,
`peak_rss_mb`; the first line is the CPU (`machine.machine_header`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs
from serve_load import ArtServe, Outcome, fire, reset_peak, sample, slope, tally, wait_fds_settle

GROUP_SIZE = 4


def after_warmup(points: list[tuple[float, float]], warmup: float) -> list[tuple[float, float]]:
    """The points past the first `warmup` fraction (at least two kept when there are two)."""
    skip = min(int(len(points) * warmup), max(len(points) - 2, 0))
    return points[skip:]


def slope_of(points: list[tuple[float, float]], per: float) -> float:
    return round(slope([x for x, _ in points], [y for _, y in points]) * per, 2)


async def train_phase(serve: ArtServe, args: argparse.Namespace) -> dict[str, Any]:
    from art_core import TrainConfig, Trajectory, TrajectoryGroup

    model = serve.model
    client = model.openai_client()
    config = TrainConfig(learning_rate=1e-4)
    per_step = reset_peak(serve.pid)
    peaks: list[tuple[float, float]] = []
    started = time.perf_counter()
    for index in range(args.steps):
        if per_step:
            reset_peak(serve.pid)
        messages = [{"role": "user", "content": f"Step {index}: name a fruit."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=args.max_tokens,
            n=GROUP_SIZE, temperature=1.0, seed=index,
        )  # fmt: skip
        group = TrajectoryGroup(
            Trajectory(messages_and_choices=[*messages, choice], reward=i / (GROUP_SIZE - 1))
            for i, choice in enumerate(completion.choices)
        )
        result = await model.train([group], config)
        if not result.trained:
            raise RuntimeError(f"step {index + 1} trained nothing: {result.warnings}")
        peaks.append((float(result.step), sample(serve.pid).hwm_mb))
        if (index + 1) % 50 == 0:
            print(f"train step {result.step}: peak RSS {peaks[-1][1]:.1f} MB", flush=True)
    await client.close()
    return {
        "train_steps": len(peaks),
        "train_peak_per_step": per_step,
        "train_rss_slope_mb_per_100_steps": slope_of(after_warmup(peaks, args.train_warmup), 100),
        "train_rss_slope_all_mb_per_100_steps": slope_of(peaks, 100),
        "train_peak_first_mb": round(peaks[0][1], 1) if peaks else None,
        "train_peak_last_mb": round(peaks[-1][1], 1) if peaks else None,
        "train_peak_max_mb": round(max(p for _, p in peaks), 1) if peaks else None,
        "train_s": round(time.perf_counter() - started, 1),
    }


async def serve_phase(serve: ArtServe, args: argparse.Namespace) -> dict[str, Any]:
    url, model = serve.chat_url, serve.chat_model
    start = sample(serve.pid)
    points: list[tuple[float, float]] = [(0.0, start.rss_mb)]
    fd_max = start.fds
    done = 0

    def on_done(_: int, __: Outcome) -> None:
        nonlocal done, fd_max
        done += 1
        if done % args.sample_every == 0:
            now = sample(serve.pid)
            points.append((float(done), now.rss_mb))
            fd_max = max(fd_max, now.fds)
            if done % (args.sample_every * 10) == 0:
                print(f"served {done}: RSS {now.rss_mb:.1f} MB, {now.fds} fds", flush=True)

    started = time.perf_counter()
    outcomes = await fire(
        url, model, args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
        start=10**7, on_done=on_done,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    serve.alive_or_raise()
    fd_end = await wait_fds_settle(serve.pid, start.fds)
    end = sample(serve.pid)
    return {
        **tally(outcomes),
        "serve_rss_slope_mb_per_10k": slope_of(after_warmup(points, args.serve_warmup), 10_000),
        "serve_rss_slope_all_mb_per_10k": slope_of(points, 10_000),
        "serve_rss_start_mb": round(start.rss_mb, 1),
        "serve_rss_end_mb": round(end.rss_mb, 1),
        "serve_rss_readings_mb": [round(rss) for _, rss in points],
        "fd_start": start.fds,
        "fd_end": fd_end,
        "fd_max": fd_max,
        "concurrency": args.concurrency,
        "serve_s": round(seconds, 1),
        "peak_rss_mb": round(end.hwm_mb, 1),
    }


async def soak(serve: ArtServe, args: argparse.Namespace) -> dict[str, Any]:
    try:
        await serve.register("soak", args.model)
        trained = await train_phase(serve, args)
        served = await serve_phase(serve, args)
    finally:
        await serve.close()
    return {
        **trained,
        **served,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "prefix_cache_mib": args.prefix_cache_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="train steps (default 300)")
    parser.add_argument("--requests", type=int, default=20_000, help="chat requests (default 20000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    parser.add_argument("--model", default="tiny-random", help="base model (default tiny-random, local)")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request (default 8)")
    parser.add_argument("--sample-every", type=int, default=500, help="requests between RSS readings")
    parser.add_argument(
        "--train-warmup", type=float, default=0.1, help="leading fraction of steps left out of the slope"
    )
    parser.add_argument(
        "--serve-warmup", type=float, default=0.25, help="leading fraction of requests left out of the slope"
    )
    parser.add_argument(
        "--prefix-cache-mib", type=int, help="art serve --prefix-cache-mib (default: its own)"
    )
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP threads (default 1)")
    parser.add_argument("--root", type=Path, help="the server's folder (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 2 or args.requests < 2 or args.concurrency < 1 or args.sample_every < 1:
        parser.error("--steps and --requests must be >= 2, --concurrency and --sample-every >= 1")
    if not (0 <= args.train_warmup < 1 and 0 <= args.serve_warmup < 1):
        parser.error("--train-warmup and --serve-warmup must be in [0, 1)")
    extra = [] if args.prefix_cache_mib is None else ["--prefix-cache-mib", str(args.prefix_cache_mib)]
    print(machine_header(), flush=True)
    with tempfile.TemporaryDirectory(prefix="art-soak-") as tmp:
        serve = ArtServe(args.root or Path(tmp), extra_args=extra, threads=args.threads)
        try:
            serve.start()
            print(f"art serve up at {serve.url} (pid {serve.pid})", flush=True)
            result = asyncio.run(soak(serve, args))
        finally:
            serve.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
