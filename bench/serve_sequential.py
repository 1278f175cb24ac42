"""The "sequential" side of `serve_throughput.py`: HF `generate`, batch size 1, one prompt after another.

`worker_sequential` (in its own process) merges the saved adapter into the base model (fp32
merge, then cast to `--dtype`, as our serving copy does), checks the greedy text with and without
it, and times `--sequential-requests` prompts one at a time; `run_sequential` runs it and reads
its result. Left out: the load and the report (`serve_throughput.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from processes import emit, log_tail, read_marked
from serve_common import CHECK_TOKENS, MODEL, chat_prompts, dtype_of, start_worker


def worker_sequential(args: argparse.Namespace) -> None:
    """HF `generate`, batch size 1, prompt after prompt, on the base model with the adapter merged."""
    import torch
    from peft import PeftModel

    from art_core.models.chat_template import render_prompt
    from art_core.models.loading import load_model

    torch.set_num_threads(args.threads)
    dtype = dtype_of(args.dtype)
    loaded = load_model(MODEL)
    tokenizer, pad = loaded.tokenizer, loaded.tokenizer.pad_token_id
    chats = chat_prompts(args.requests)[: args.sequential_requests]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]

    def generate(model: Any, ids: list[int], tokens: int, greedy: bool) -> list[int]:
        sampling: dict[str, Any] = {"do_sample": False}
        if not greedy and args.temperature > 0:
            sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad, **sampling,
            )  # fmt: skip
        return out[0, len(ids) :].tolist()

    base_check = tokenizer.decode(
        generate(loaded.model.to(dtype), prompts[0], CHECK_TOKENS, greedy=True), skip_special_tokens=True
    )
    loaded = load_model(MODEL)  # fp32 again: merge in fp32, then cast, as our serving copy does
    peft_model = PeftModel.from_pretrained(loaded.model, args.adapter_dir, is_trainable=False)
    model: Any = peft_model.merge_and_unload().to(dtype).eval()
    adapter_check = tokenizer.decode(
        generate(model, prompts[0], CHECK_TOKENS, greedy=True), skip_special_tokens=True
    )
    generate(model, prompts[0], args.max_tokens, greedy=False)  # warm-up
    started, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(generate(model, ids, args.max_tokens, greedy=False)) for ids in prompts)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    emit(
        "result",
        {
            "tok_s": tokens / elapsed,
            "seconds": elapsed,
            "cpu_s": cpu,
            "tok_per_cpu_s": tokens / cpu if cpu > 0 else None,
            "requests": len(prompts),
            "tokens": tokens,
            "prompt_tokens": statistics.mean(map(len, prompts)),
            "dtype": str(dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "check_base": base_check,
            "check_adapter": adapter_check,
        },
    )


# --------------------------------------------------------------------------------------------------
# the driver


def run_sequential(args: argparse.Namespace, work: Path, adapter_dir: str) -> dict[str, Any]:
    extra = ["--adapter-dir", adapter_dir, "--sequential-requests", str(args.sequential_requests)]
    proc = start_worker("sequential", args, work, extra)
    try:
        result = read_marked(proc, "result")
        proc.wait(timeout=60)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; its log ends:\n{log_tail(work / 'sequential.log')}") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result["threads"] = result["torch_threads"]
    return result
