"""The "ours" side of `serve_throughput.py`: our OpenAI-compatible server on a LocalBackend, live LoRA.

`worker_ours` (in its own process) registers a `TrainableModel` on a `LocalBackend` as training
does, writes seeded random lora_B weights into the live adapter inside `engine.pause()` /
`engine.resume()` (what a train step does), saves the adapter for the other sides and serves it,
answering `stats` (the engine's batch and join counters) on stdin. `start_ours` and `stop_ours`
drive that process. Left out: the load and the report (`serve_throughput.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from processes import emit, log_tail, read_marked
from serve_common import (
    LORA_ALPHA,
    LORA_B_STD,
    LORA_R,
    LORA_SEED,
    MODEL,
    MODEL_NAME,
    Target,
    dtype_of,
    say,
    start_worker,
)


def worker_ours(args: argparse.Namespace) -> None:
    """Register the model on a LocalBackend, put the random adapter into the live LoRA, serve it."""
    from art_core.engine.onednn import bound_primitive_caches
    from art_core.engine.openmp import prefer_short_spin, release_thread_pool, wait_policy
    from art_core.models.allocator import keep_freed_memory

    prefer_short_spin()  # what the `art` CLI does; before torch loads its OpenMP
    bound_primitive_caches()  # and its oneDNN primitive caches
    keep_freed_memory()  # and glibc's heap thresholds
    import torch

    from art_core.backends.local import LocalBackend
    from art_core.engine.config import EngineConfig
    from art_core.engine.replicas import ReplicatedEngine
    from art_core.engine.torch.threads import usable_cpus
    from art_core.host.serving import TorchServing
    from art_core.model import TrainableModel
    from art_core.models.loading import resolve_model_path

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    unmerged = {"auto": None, "merged": False, "unmerged": True}[args.serving_copy]
    config = EngineConfig(serve_dtype=dtype_of(args.dtype), serve_unmerged=unmerged)
    processes = args.replica_mode == "process"
    serving = TorchServing(engine_config=config, replicas=args.replicas, replica_processes=processes)
    backend = LocalBackend(work / "art", serving=serving)
    model = TrainableModel(
        project="bench", name=MODEL_NAME, base_model=MODEL, lora_rank=LORA_R, lora_alpha=LORA_ALPHA
    )
    started = time.perf_counter()
    asyncio.run(model.register(backend))
    hosted = backend.service.get(MODEL_NAME)
    engine: Any = hosted.engine  # a TorchEngine (the default), or a ReplicatedEngine of them (--replicas)
    # What a train step does to the live adapter: change its weights while the engine is paused.
    engine.pause()
    try:
        generator = torch.Generator().manual_seed(LORA_SEED)
        changed = 0
        with torch.no_grad():
            for name, param in hosted.trainer.model.named_parameters():
                if "lora_B" in name and f".{hosted.trainer.adapter_name}." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
                    changed += 1
        if hosted.copies is not None:  # the other replicas get the step, as after a train step
            hosted.copies.publish()
    finally:
        engine.resume()
    adapter_dir = work / "adapter"
    hosted.trainer.save_state(adapter_dir)
    release_thread_pool()  # this thread is done with torch: its OpenMP workers would throttle the engine's
    first = engine.replicas[0] if isinstance(engine, ReplicatedEngine) else engine
    serving_model = getattr(first, "serving_model", None)  # None in a replica process
    if processes and args.replicas > 1:
        threads = f"{max(1, usable_cpus() // args.replicas)} per replica process"
        serve_dtype = f"{args.dtype} (procs)"
    else:
        threads = f"{torch.get_num_threads()} (OMP wait {wait_policy().lower()})"
        serve_dtype = str(serving_model.dtype).removeprefix("torch.") if serving_model is not None else "peft"
        if getattr(first, "serves_unmerged", False):
            serve_dtype += ", LoRA unmerged"
    emit(
        "ready",
        {
            "base_url": model.inference_base_url,
            "api_key": model.inference_api_key,
            "model": model.get_inference_name(),
            "model_path": str(resolve_model_path(MODEL)),
            "adapter_dir": str(adapter_dir),
            "lora_b_tensors": changed,
            "serve_dtype": serve_dtype,
            "trainer_dtype": str(next(hosted.trainer.model.parameters()).dtype).removeprefix("torch."),
            "torch_threads": threads,
            "torch": torch.__version__,
            "setup_s": round(time.perf_counter() - started, 1),
            "replicas": args.replicas,
        },
    )
    for line in sys.stdin:  # the benchmark's commands; EOF (it died) also ends the worker
        if line.strip() == "stats":
            stats = engine.stats()
            emit(
                "stats",
                {"batches": stats.batches, "rows": stats.rows, "tokens": stats.tokens, "joins": stats.joins},
            )
        elif line.strip() == "stop":
            break
    asyncio.run(backend.close())


def start_ours(
    args: argparse.Namespace, work: Path, replicas: int = 1, key: str = "ours", mode: str = "process"
) -> tuple[subprocess.Popen[str], dict[str, Any], Target]:
    """Our server (a LocalBackend in its worker process, `replicas` TorchEngines, in child processes
    or threads: `mode`), up and serving the live adapter; `work` is its own folder (its model
    storage, adapter and log)."""
    work.mkdir(parents=True, exist_ok=True)
    extra = ["--replicas", str(replicas), "--replica-mode", mode, "--serving-copy", args.serving_copy]
    proc = start_worker("ours", args, work, extra)
    try:
        ready = read_marked(proc, "ready")
    except RuntimeError as exc:
        stop_ours(proc)
        raise RuntimeError(f"{exc}; its log ends:\n{log_tail(work / 'ours.log')}") from exc
    say(
        f"{key}: {replicas} replica(s){'' if replicas == 1 else ' (processes)' if mode == 'process' else ' (threads)'}; registered {ready['model']!r} in {ready['setup_s']} s; {ready['lora_b_tensors']} lora_B "
        f"tensors set to N(0, {LORA_B_STD}); serving copy {ready['serve_dtype']} (trainer "
        f"{ready['trainer_dtype']}), torch {ready['torch']}, {ready['torch_threads']} threads"
    )

    def batches() -> dict[str, int]:
        assert proc.stdin is not None
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        return dict(read_marked(proc, "stats"))

    target = Target(key, ready["base_url"], ready["api_key"], ready["model"], proc.pid, batches)
    return proc, ready, target


def stop_ours(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
