"""Where our train step's time goes, op by op: torch.profiler over `bench/train_step.py`'s step.

    python bench/profile_train_step.py [--steps 2] [--top 25]

The same shape as bench/train_step.py (SmolLM2-135M-Instruct, one chat prompt, 8 completions of
64 tokens, LoRA r=8 on every projection, the grpo loss, one AdamW step) with random completion
tokens (the time does not depend on which tokens) after three warm-up steps (the first two fault
the heap's pages in: elementwise ops ran ~3x slower in them). Prints the machine
header, the ops by self CPU time, and the share of the matmul ops (mm, addmm, bmm, baddbmm and
their oneDNN forms) against everything else. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_mkldnn_matmul",
        "mkldnn::_linear_pointwise",
    }
)


def build(threads: int) -> tuple[Any, Any]:
    import torch

    from art_core.models.loading import load_model
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn
    from art_core.training.batch import prepare_batch
    from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
    from art_core.training.lora import attach_lora
    from art_core.training.trainer import Trainer

    torch.set_num_threads(threads)
    loaded = load_model("smollm2-135m")
    rendered: Any = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(100, 20000, (8, 64), generator=generator).tolist()
    group = TrajectoryGroup(
        [
            Trajectory(
                turns=[Turn(prompt_ids=prompt, completion_ids=c, logprobs=[float("nan")] * 64)],
                reward=float(i % 2 == 0),
            )
            for i, c in enumerate(completions)
        ]
    )
    batch = prepare_batch([group], scale_rewards=True, max_context=loaded.max_context)
    model = attach_lora(loaded.model, LoRAConfig(r=8, alpha=16))
    config = TrainConfig(learning_rate=1e-5, loss=LossConfig(name="grpo"))
    return Trainer(model, pad_id=loaded.tokenizer.pad_token_id, config=config), batch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="steps before the profiled ones (default 3: until the heap stops growing)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from art_core.models.allocator import keep_freed_memory

    keep_freed_memory()  # what the `art` CLI does for its own process
    print(machine_header(), flush=True)
    trainer, batch = build(args.threads)
    for _ in range(args.warmup):  # the first steps fault the heap's pages in (~270,000 each)
        trainer.train_step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            trainer.train_step(batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    top = {e.key: round(e.self_cpu_time_total / total, 4) for e in ranked[: args.top]}
    print(json.dumps({"steps": args.steps, "self_cpu_s": round(total / 1e6, 2),
                      "matmul_share": round(matmul / total, 3), "top": top}))  # fmt: skip


if __name__ == "__main__":
    main()
