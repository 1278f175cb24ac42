"""What observability costs a train step: sinks off vs W&B (offline) + Langfuse (to a local endpoint) on.

Two backends in one process train the same model ("tiny-random", or `--model smollm2-135m`) on the
same groups, one with every sink off (`ObserveConfig(wandb=False, langfuse=False)`), one with W&B
in offline mode and Langfuse exporting to an endpoint on 127.0.0.1 that accepts and discards.
Rounds alternate the two, so machine load hits both alike; the figure is the median wall time of
`model.train` (the step's critical path; history.jsonl and the trajectories' JSONL are written in
both). The sinks' own work runs on their background thread; the time to drain it at the end is
printed too. The last line is JSON: `{"off_s", "on_s", "overhead", "drain_s", ...}`; goal < 2%.

    python bench/observability_overhead.py [--model tiny-random] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_core.backends import LocalBackend
from art_core.host.sinks import ObserveConfig


class _Discard(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        payload = b'{"message": "Accepted"}'
        self.send_response(202 if self.path.endswith("/scores") else 200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


async def _groups(model: TrainableModel, groups: int, size: int) -> list[TrajectoryGroup]:
    async def one(g: int, i: int) -> Trajectory:
        messages = [{"role": "user", "content": f"task {g}: say something ({i})"}]
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=16
        )
        return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=float(i))

    return await gather_trajectory_groups(
        [TrajectoryGroup(one(g, i) for i in range(size)) for g in range(groups)], pbar=False
    )


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_DIR=str(root),
        WANDB_SILENT="true",
        LANGFUSE_PUBLIC_KEY="pk-lf-bench",
        LANGFUSE_SECRET_KEY="sk-lf-bench",
        LANGFUSE_HOST=f"http://127.0.0.1:{server.server_address[1]}",
    )
    off_backend = LocalBackend(root / "off", observe=ObserveConfig(wandb=False, langfuse=False))
    on_backend = LocalBackend(root / "on", observe=ObserveConfig(wandb=True, langfuse=True))
    models = {}
    for key, backend in (("off", off_backend), ("on", on_backend)):
        models[key] = TrainableModel(project="bench", name=f"obs-{key}", base_model=args.model)
        await models[key].register(backend)
    groups = await _groups(models["off"], args.groups, args.group_size)
    config = TrainConfig(learning_rate=1e-5)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.rounds + 1):  # round 0 warms both up (W&B starts its run there)
        for key in ("off", "on") if round_ % 2 else ("on", "off"):
            started = time.perf_counter()
            await models[key].train(groups, config=config)
            if round_:
                times[key].append(time.perf_counter() - started)
    started = time.perf_counter()
    await on_backend.close()
    drain = time.perf_counter() - started
    await off_backend.close()
    server.shutdown()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "model": args.model,
        "rounds": args.rounds,
        "trajectories_per_step": args.groups * args.group_size,
        "off_s": round(off, 4),
        "on_s": round(on, 4),
        "overhead": round(on / off - 1.0, 4),
        "drain_s": round(drain, 3),
        "off_all_s": [round(t, 4) for t in times["off"]],
        "on_all_s": [round(t, 4) for t in times["on"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    with tempfile.TemporaryDirectory() as root:
        result = asyncio.run(run(args, Path(root)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
