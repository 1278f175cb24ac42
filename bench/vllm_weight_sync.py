"""VLLMEngine's two ways of serving a trained step, against ours: decode speed and publish time.

Three sides, each in its own process, one after the other, on the same random LoRA (rank 16 on
every projection of SmolLM2-135M, seeded, as `serve_throughput.py` uses):
- `lora`: `VLLMEngine(weight_sync="lora")`, the step hot-loaded as an adapter (`add_adapter`);
- `merged`: `VLLMEngine(weight_sync="merged")`, the step merged into the weights (`load_merged`);
- `ours`: `TorchEngine` on the peft model with that adapter live (its merged bf16 serving copy).
Each side publishes the step `--publishes` times (the median is the per-step cost), then runs one
warm-up round and `--repeats` timed rounds of `--requests` concurrent requests of `--max-tokens`
sampled tokens (ignore_eos: every round decodes the same number of tokens); it reports the median
round's tok/s. Engine level, no HTTP (serve_throughput.py measures the HTTP servers). The sides do
not take turns round by round, so on a shared machine they are noisier than serve_throughput.py's.

The vLLM sides need `.venv-vllm` (scripts/setup_vllm_cpu.sh); run the script with that Python:
    .venv-vllm/bin/python bench/vllm_weight_sync.py [--requests 16] [--max-tokens 64] [--repeats 2]
        [--dtype bfloat16] [--threads 2] [--publishes 3] [--sides lora,merged,ours] [--json]
The last line printed is one JSON object: {"<side>": {"tok_s", "publish_s", ...}, "merged_vs_lora",
"merged_vs_ours"}. Results and what they mean: docs/benchmarks.md ("vLLM: merged weights or adapters").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from processes import bind_cpus, thread_env  # bench/ is on sys.path when a bench script runs
from serve_common import (
    DTYPES,
    LORA_ALPHA,
    LORA_B_STD,
    LORA_R,
    LORA_SEED,
    MODEL,
    chat_prompts,
    dtype_of,
    resolved_dtype,
)

SIDES = ("lora", "merged", "ours")
MARK = "@@side "


def make_adapter(out: Path) -> Path:
    """The seeded random LoRA (B ~ N(0, LORA_B_STD)) saved as a peft folder; returns the folder."""
    import torch

    from art_core.models.loading import load_model
    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora

    loaded = load_model(MODEL)
    peft_model = attach_lora(loaded.model, LoRAConfig(r=LORA_R, alpha=LORA_ALPHA), adapter_name="live")
    generator = torch.Generator().manual_seed(LORA_SEED)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
    peft_model.save_pretrained(str(out), selected_adapters=["live"])
    return out / "live"


def _prompts(tokenizer: Any, count: int) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in chat_prompts(count)
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


async def _rounds(
    engine: Any, prompts: list[list[int]], adapter: str | None, args: argparse.Namespace
) -> list[float]:
    """tok/s of the warm-up round, then of each timed round."""
    from art_core.engine.config import GenerationRequest
    from art_core.engine.sampling import SamplingParams

    rates = []
    for round_no in range(args.repeats + 1):
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=round_no * 1000 + i
            )
            for i in range(len(prompts))
        ]
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                engine.generate(GenerationRequest(p, sp, adapter))
                for p, sp in zip(prompts, params, strict=True)
            )
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for r in results for c in r)
        rates.append(tokens / seconds)
    return rates


def run_side(side: str, adapter_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from art_core.models.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(MODEL)
    prompts = _prompts(loaded.tokenizer, args.requests)
    started = time.perf_counter()
    publish: list[float] = []
    if side == "ours":
        from peft import PeftModel

        from art_core.engine.config import EngineConfig
        from art_core.engine.torch.engine import TorchEngine

        peft_model = PeftModel.from_pretrained(loaded.model, str(adapter_dir), adapter_name="live")
        engine: Any = TorchEngine(
            peft_model, loaded.tokenizer, EngineConfig(serve_dtype=dtype_of(args.dtype))
        )
        adapter: str | None = "live"
        for _ in range(args.publishes):  # what a train step's publish costs here: pause, new weights, resume
            t0 = time.perf_counter()
            engine.pause()
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_B" in name:
                        param.mul_(1.0)
            engine.resume()
            publish.append(time.perf_counter() - t0)
    else:
        from art_core.engine.vllm.engine import VLLMEngine, VLLMEngineConfig

        config = VLLMEngineConfig(
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=1024,
            kv_cache_gib=args.kv_gib,
            sleep_mode=False,
            max_lora_rank=LORA_R,
            max_loras=1,
            weight_sync="merged" if side == "merged" else "lora",
        )
        engine = VLLMEngine(loaded.path, tokenizer=loaded.tokenizer, config=config)
        adapter = "step"
        for _ in range(args.publishes):
            t0 = time.perf_counter()
            if side == "merged":
                engine.load_merged(adapter_dir, [adapter])
            else:
                engine.add_adapter(adapter, adapter_dir)
            publish.append(time.perf_counter() - t0)
    setup_s = time.perf_counter() - started
    try:
        rates = asyncio.run(_rounds(engine, prompts, adapter, args))
    finally:
        engine.close()
    return {
        "tok_s": round(statistics.median(rates[1:]), 1),
        "warmup_tok_s": round(rates[0], 1),
        "rounds_tok_s": [round(r, 1) for r in rates[1:]],
        "publish_s": round(statistics.median(publish), 3),
        "setup_s": round(setup_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per request (ignore_eos)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per side (after one warm-up)")
    parser.add_argument("--publishes", type=int, default=3, help="publishes of the step per side (median)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto: bfloat16 where the CPU has native bf16, else float32",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of every engine")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="vLLM KV cache (GiB)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of " + ", ".join(SIDES))
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = resolved_dtype(args.dtype)  # sides get the concrete dtype: every side runs the same
    if args.side:  # a side's own process
        print(MARK + json.dumps(run_side(args.side, Path(args.adapter_dir), args)), flush=True)
        return
    sides = [s for s in args.sides.split(",") if s]
    if unknown := set(sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {SIDES}")
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-weight-sync-") as tmp:
        adapter_dir = make_adapter(Path(tmp))
        env = {**thread_env(args.threads), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        # vLLM's own default binds its worker to one core and keeps the other for its scheduler; on a
        # shared 2-core machine that one core is then shared with everything else (see serve_vllm.py)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind_cpus(args.threads))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, args.kv_gib))))
        for side in sides:
            argv = [sys.executable, __file__, "--side", side, "--adapter-dir", str(adapter_dir)]
            for flag in ("requests", "max_tokens", "repeats", "publishes", "dtype", "threads", "kv_gib"):
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            log(f"{side}: running")
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=os.getcwd())
            lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
            if proc.returncode != 0 or not lines:
                log(f"{side}: failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
                results[side] = None
                continue
            results[side] = json.loads(lines[-1].removeprefix(MARK))
            log(f"{side}: {results[side]}")

    def ratio(a: str, b: str) -> float | None:
        if results.get(a) and results.get(b):
            return round(results[a]["tok_s"] / results[b]["tok_s"], 2)
        return None

    results["merged_vs_lora"] = ratio("merged", "lora")
    results["merged_vs_ours"] = ratio("merged", "ours")
    results["config"] = {
        k: getattr(args, k) for k in ("requests", "max_tokens", "repeats", "dtype", "threads")
    }
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
