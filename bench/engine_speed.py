"""Throughput of TorchEngine serving a live LoRA adapter: peft's per-row path against the merged copy.

Setup: SmolLM2-135M-Instruct (fp32) wrapped in peft LoRA r=16, alpha=32 on q/k/v/o/gate/up/down,
adapter "live" with random non-zero lora_B (so the adapter changes the outputs), as the service
builds it. `--requests` (32) concurrent requests, each a different short chat prompt (~30-40
tokens), greedy, exactly `--tokens` (64) new tokens (eos ignored), all for adapter "live".

Modes (each on the same model object, one engine at a time):
- peft-fp32:   EngineConfig(merged_serving=False): every forward passes `adapter_names` (the old path).
- merged-fp32: the merged serving copy in float32 (exact to ~1e-5).
- merged-bf16: the merged serving copy in bfloat16 (the default on CPUs with AMX / AVX512-BF16).
- hf-bf16:     reference ceiling: a plain bf16 copy of the base model, HF `generate` on one padded batch.

A time is the wall time of one round of all requests (asyncio.gather), median of `--repeats`
rounds after a warm-up round; `tok_per_cpu_s` divides by the process's CPU time instead, which
other programs on a shared machine disturb much less (with `--threads 1` it estimates the idle
single-thread rate). Also timed: building the serving copy, a forced full re-merge, and
the re-merge after a simulated train step (lora_B changed in place: only the LoRA layers are
rewritten). The machine's load (`os.getloadavg`) is printed before and after; run it with nothing
else heavy running. The last line printed is a JSON object.

Usage: python bench/engine_speed.py [--threads 2] [--repeats 3] [--modes peft-fp32,merged-bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from typing import Any

import torch
from machine import machine_header  # bench/ is on sys.path when a bench script runs
from topics import TOPICS

MODEL = "smollm2-135m"


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def live_model() -> tuple[Any, Any]:
    from art_core.models.loading import load_model
    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora

    loaded = load_model(MODEL)
    model = attach_lora(loaded.model, LoRAConfig(r=16, alpha=32), adapter_name="live")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    model.eval()
    return model, loaded.tokenizer


async def one_round(engine: Any, ps: list[list[int]], tokens: int) -> tuple[float, float, int]:
    from art_core.engine.config import GenerationRequest
    from art_core.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    started, cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*[engine.generate(GenerationRequest(p, params, "live")) for p in ps])
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return elapsed, cpu, sum(len(c.token_ids) for r in results for c in r)


def engine_mode(model: Any, tokenizer: Any, mode: str, ps: list[list[int]], args: Any) -> dict[str, Any]:
    from art_core.engine.config import EngineConfig
    from art_core.engine.torch.engine import TorchEngine

    configs = {
        "peft-fp32": EngineConfig(merged_serving=False, stop_on_eos=False),
        "merged-fp32": EngineConfig(serve_dtype=torch.float32, stop_on_eos=False),
        "merged-bf16": EngineConfig(serve_dtype=torch.bfloat16, stop_on_eos=False),
    }
    started = time.perf_counter()
    engine = TorchEngine(model, tokenizer, configs[mode])
    build_s = time.perf_counter() - started
    try:
        rounds = [asyncio.run(one_round(engine, ps, args.tokens)) for _ in range(args.repeats + 1)][1:]
    finally:
        engine.close()
    times = [t for t, _, _ in rounds]
    tokens = rounds[0][2]
    return {
        "tok_s": round(tokens / statistics.median(times), 1),
        "tok_per_cpu_s": round(tokens / statistics.median([c for _, c, _ in rounds]), 1),
        "round_s": [round(t, 2) for t in times],
        "tokens": tokens,
        "engine_build_s": round(build_s, 3),
    }


def hf_reference(model: Any, tokenizer: Any, ps: list[list[int]], args: Any) -> dict[str, Any]:
    from art_core.engine.torch.serving_weights import MergedWeights

    plain: Any = MergedWeights(model, None, torch.bfloat16).model  # the base weights, bf16, no peft
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in ps)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    times, cpus = [], []
    for _ in range(args.repeats + 1):
        started, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = plain.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
        times.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
    tokens = (out.shape[1] - width) * len(ps)
    return {
        "tok_s": round(tokens / statistics.median(times[1:]), 1),
        "tok_per_cpu_s": round(tokens / statistics.median(cpus[1:]), 1),
        "round_s": [round(t, 2) for t in times[1:]],
    }


def merge_times(model: Any, args: Any) -> dict[str, float]:
    from art_core.engine.torch.serving_weights import MergedWeights

    started = time.perf_counter()
    merged = MergedWeights(model, "live", torch.bfloat16)
    build = time.perf_counter() - started
    forced, trained = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        merged.sync(model, force=True)
        forced.append(time.perf_counter() - started)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(1.0001)
        started = time.perf_counter()
        merged.sync(model)
        trained.append(time.perf_counter() - started)
    started = time.perf_counter()
    merged.sync(model)
    check = time.perf_counter() - started
    return {
        "build_s": round(build, 3),
        "full_remerge_s": round(statistics.median(forced), 3),
        "after_train_step_remerge_s": round(statistics.median(trained), 3),
        "unchanged_check_ms": round(check * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="peft-fp32,merged-fp32,merged-bf16,hf-bf16")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(machine_header(), flush=True)
    torch.set_num_threads(args.threads)
    model, tokenizer = live_model()
    ps = prompts(tokenizer, args.requests)
    report: dict[str, Any] = {
        "threads": args.threads, "requests": args.requests, "tokens": args.tokens,
        "prompt_tokens": [min(map(len, ps)), max(map(len, ps))], "load_before": os.getloadavg(),
    }  # fmt: skip
    for mode in args.modes.split(","):
        if mode == "hf-bf16":
            report[mode] = hf_reference(model, tokenizer, ps, args)
        else:
            report[mode] = engine_mode(model, tokenizer, mode, ps, args)
        print(mode, report[mode], "load", os.getloadavg(), flush=True)
    report["merge"] = merge_times(model, args)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
