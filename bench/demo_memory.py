"""Where `art demo`'s memory goes: RSS at phase boundaries and the tensors that make it up.

    python bench/demo_memory.py --steps 6

Runs the demo task in-process (the same `run_demo` as `art demo`) and prints, at each phase
boundary (imports, model registered, every step), the process's RSS and high-water mark from
/proc/self/status, and the bytes of distinct tensor storages by owner: the base weights the
trainer holds, the LoRA and its AdamW state, the engine's serving copy, its prefix cache, and any
other live tensor. RSS minus the tensors is the interpreter, the imported libraries and the
allocator's free-but-kept memory. tracemalloc cannot see torch's allocations, so the tensors are
summed from their storages. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

MB = 1e6


def proc_status() -> dict[str, float]:
    """VmRSS, VmHWM (peak RSS) and RssAnon of this process, in MB."""
    out: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024 / MB
    return out


def _storage_key(tensor: Any) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if tensor.device.type != "cpu" or storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def _add(owner: str, tensors: Any, seen: dict[int, str], sizes: dict[str, float]) -> None:
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is None or key[0] in seen:
            continue
        seen[key[0]] = owner
        sizes[owner] = sizes.get(owner, 0.0) + key[1] / MB


def tensor_owners(backend: Any) -> dict[str, float]:
    """MB of distinct CPU tensor storages, by owner (first owner wins for shared storages)."""
    import torch

    seen: dict[int, str] = {}
    sizes: dict[str, float] = {}
    for hosted in backend.service._models.values():
        trainer, engine = hosted.trainer, hosted.engine
        lora = [p for p in trainer.params]
        _add("lora params", lora, seen, sizes)
        _add("lora grads", [p.grad for p in lora if p.grad is not None], seen, sizes)
        state = [
            v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        _add("optimizer state", state, seen, sizes)
        serving = getattr(engine, "_serving", None)
        if serving is not None:
            smodel = serving.model
            fused = [
                t
                for m in smodel.modules()
                for a in ("art_qkv", "art_gate_up")
                if (f := getattr(m, a, None))
                for t in f
                if t is not None
            ]
            _add("serving copy", [*fused, *smodel.parameters(), *smodel.buffers()], seen, sizes)
            packs = getattr(smodel, "art_packed_weights", None) or {}
            _add("packed weights", [e.packed for e in packs.values()], seen, sizes)
        prefix = getattr(engine, "_prefix", None)
        if prefix is not None:
            sizes["prefix cache"] = prefix.stats().bytes / MB
        _add("base weights", [*hosted.loaded.model.parameters(), *hosted.loaded.model.buffers()], seen, sizes)
    others = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    _add("other tensors", others, seen, sizes)
    return {k: round(v, 1) for k, v in sizes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--arenas", type=int, default=2, help="glibc malloc arenas, as `art demo` sets (0: glibc's default)"
    )
    args = parser.parse_args()
    if args.arenas:
        from art_core.models.allocator import limit_arenas

        limit_arenas(args.arenas)
    print(machine_header(), flush=True)
    rows: list[dict[str, Any]] = [{"phase": "start", **proc_status()}]
    import torch  # noqa: F401

    rows.append({"phase": "import torch", **proc_status()})
    import transformers  # noqa: F401

    rows.append({"phase": "import transformers", **proc_status()})
    from art_core.app import demo

    rows.append({"phase": "import art_core.app.demo", **proc_status()})
    for name in ("openai", "litellm", "peft", "fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            continue
        rows.append({"phase": f"import {name}", **proc_status()})
    holder: dict[str, Any] = {}

    class ProbedBackend(demo.LocalBackend):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            holder["backend"] = self

    demo.LocalBackend = ProbedBackend  # type: ignore[misc]
    started = time.perf_counter()

    def on_step(step: int, reward: float, seconds: float) -> None:
        rows.append(
            {
                "phase": f"step {step}",
                "reward": reward,
                "s": round(seconds, 1),
                **proc_status(),
                "tensors": tensor_owners(holder["backend"]),
            }
        )

    with tempfile.TemporaryDirectory() as tmp:
        config = demo.DemoConfig(base_model=args.model, steps=args.steps, path=Path(tmp))
        summary = asyncio.run(demo.run_demo(config, on_step))
    rows.append({"phase": "end", **proc_status()})
    modules = sorted(
        {m.split(".")[0] for m in sys.modules}
        & {"litellm", "openai", "peft", "fastapi", "uvicorn", "trl", "httpx", "pydantic"}
    )
    for row in rows:
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}))
    print(
        json.dumps(
            {
                "wall_s": round(time.perf_counter() - started, 1),
                "peak_mb": rows[-1]["VmHWM"],
                "rewards": summary.rewards,
                "modules": modules,
            }
        )
    )


if __name__ == "__main__":
    main()
