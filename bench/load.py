"""2,000 concurrent chat requests at a real `art serve` on 127.0.0.1 (issue 18, load).

    python bench/load.py [--requests 2000] [--concurrency N] [--model tiny-random] [--max-tokens 8]
                         [--max-queued-rows N] [--max-concurrent-requests N] [--after 5]

Starts `art serve` (tiny model by default, built locally: nothing is downloaded), registers one
LoRA model on it through `RemoteBackend`, then sends `--requests` chat requests all at once
(`--concurrency` defaults to `--requests`: every request is in flight together), each with its
own connection, no retries. Every answer must be a 200 with a choice or an explicit refusal, 429 or
503 with an integer `Retry-After` (the engine's `max_queued_rows`, the app's
`max_concurrent_requests`); anything else (another status, a refusal without Retry-After, a
reset connection, a timeout) is an `other_error`. Then `--after` requests one by one must all be
200 (`after_ok`: normal service right after). The server's memory is read from /proc/PID/status
while the load runs (VmRSS every 0.25 s; `peak_rss_gb` is VmHWM, the high-water mark since start).

The last line of stdout is one JSON object: `requests`, `ok`, `rejected_429_503`, `other_errors`,
`p50_s`, `p99_s` (latency of every answer, refusals included), `peak_rss_gb`, and `rss_before_gb`,
`rss_after_gb`, `max_rss_during_gb`, `after_ok`, `after`, `fds_before`, `fds_after`, `wall_s`,
`error_samples`. The first line is the CPU (`machine.machine_header`).
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
from serve_load import ArtServe, fire, sample, tally, wait_fds_settle

GB = 1e3  # MB per GB


async def measure(serve: ArtServe, args: argparse.Namespace) -> dict[str, Any]:
    await serve.register("load", args.model)
    url, model = serve.chat_url, serve.chat_model
    warm = await fire(url, model, 4, concurrency=1, max_tokens=args.max_tokens)  # first-call costs
    if any(o.kind != "ok" for o in warm):
        raise RuntimeError(f"the warm-up requests failed: {[o.detail for o in warm]}")
    before = sample(serve.pid)
    peak_during = [before.rss_mb]
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            peak_during.append(sample(serve.pid).rss_mb)
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    concurrency = args.concurrency or args.requests
    outcomes = await fire(url, model, args.requests, concurrency=concurrency, max_tokens=args.max_tokens)
    wall = time.perf_counter() - started
    done.set()
    await watcher
    serve.alive_or_raise()
    after = await fire(url, model, args.after, concurrency=1, max_tokens=args.max_tokens, start=10**6)
    fds_after = await wait_fds_settle(serve.pid, before.fds)
    end = sample(serve.pid)
    return {
        **tally(outcomes),
        "peak_rss_gb": round(end.hwm_mb / GB, 3),
        "rss_before_gb": round(before.rss_mb / GB, 3),
        "max_rss_during_gb": round(max(peak_during) / GB, 3),
        "rss_after_gb": round(end.rss_mb / GB, 3),
        "after": args.after,
        "after_ok": sum(o.kind == "ok" for o in after),
        "fds_before": before.fds,
        "fds_after": fds_after,
        "concurrency": concurrency,
        "max_tokens": args.max_tokens,
        "model": args.model,
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests sent (default 2000)")
    parser.add_argument("--concurrency", type=int, default=0, help="most in flight at once (default: all)")
    parser.add_argument("--model", default="tiny-random", help="base model (default tiny-random, local)")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request (default 8)")
    parser.add_argument("--max-queued-rows", type=int, help="art serve --max-queued-rows (default: its own)")
    parser.add_argument(
        "--max-concurrent-requests", type=int, help="art serve --max-concurrent-requests (default: its own)"
    )
    parser.add_argument("--after", type=int, default=5, help="one-by-one requests after the load (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP threads (default 1)")
    parser.add_argument("--root", type=Path, help="the server's folder (default: a temporary one)")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 0 or args.after < 0:
        parser.error("--requests must be >= 1, --concurrency and --after >= 0")
    print(machine_header(), flush=True)
    extra: list[str] = []
    if args.max_queued_rows is not None:
        extra += ["--max-queued-rows", str(args.max_queued_rows)]
    if args.max_concurrent_requests is not None:
        extra += ["--max-concurrent-requests", str(args.max_concurrent_requests)]
    with tempfile.TemporaryDirectory(prefix="art-load-") as tmp:
        serve = ArtServe(args.root or Path(tmp), extra_args=extra, threads=args.threads)
        try:
            serve.start()
            print(f"art serve up at {serve.url} (pid {serve.pid}); {args.requests} requests", flush=True)

            async def run() -> dict[str, Any]:
                try:
                    return await measure(serve, args)
                finally:
                    await serve.close()

            result = asyncio.run(run())
        finally:
            serve.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
