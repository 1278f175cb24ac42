"""Decode and train-step figures of one tiny random model per family (tests/helpers_families.py).

For each of Llama 3.1, Qwen2.5, Qwen3, Gemma 3, Mistral, Phi-3 and Qwen3-MoE (hidden 64, 2 layers,
a 2k-token vocabulary, LoRA r=8 on every linear projection; float32):

- decode: `TorchEngine` (merged float32 serving copy) samples 8 completions of `--tokens` tokens
  (ignore eos) for one chat prompt; tokens per second, median of `--repeats` rounds after a warm-up.
- train: `Trainer.train_step` on those 8 completions (rewards 1, 0, 1, 0...; one AdamW step);
  seconds per step, median of `--repeats` after a warm-up.
- peer: for a family on our fast path (lean decode step, packed training forward), the same model
  and data with the fast path switched off (transformers' forward), measured in the same run: the
  ratio says what the fast path buys at these sizes. A family on the transformers path has no peer.

The sizes are tiny, so these figures show per-step overheads (Python, kernel launches, masks), not
matmul throughput: they make a slow fallback visible, they do not predict a real model's speed.
The machine may be shared with other programs; the header says which CPU it was. The last line
printed is a JSON object.

Usage: python bench/families.py [--tokens 32] [--repeats 3] [--threads N] [--only llama,gemma3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from machine import machine_header  # bench/ is on sys.path when a bench script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS = 8


@contextmanager
def fast_paths(on: bool) -> Any:
    """Our lean decode step and packed training forward as they are (on), or switched off."""
    if on:
        yield
        return
    with (
        mock.patch("art_core.engine.torch.decoding.supports_decode_step", return_value=False),
        mock.patch("art_core.training.forward.supports_packed_forward", return_value=False),
    ):
        yield


def _setup(family: Any, folder: Path) -> tuple[Any, Any, Any]:
    import torch

    from art_core.models.loading import load_model
    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora
    from tests.helpers_families import build_family

    loaded = load_model(str(build_family(family, folder)))
    model = attach_lora(loaded.model, LoRAConfig(r=8, alpha=16), adapter_name="live")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    model.eval()
    return loaded, model, loaded.tokenizer


async def _decode_round(engine: Any, prompt: list[int], tokens: int) -> tuple[float, list[Any]]:
    from art_core.engine.config import GenerationRequest
    from art_core.engine.sampling import SamplingParams

    params = SamplingParams(n=ROWS, temperature=1.0, max_tokens=tokens, seed=0)
    started = time.perf_counter()
    completions = await engine.generate(GenerationRequest(prompt, params, "live"))
    return time.perf_counter() - started, completions


def measure(family: Any, folder: Path, fast: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s and train-step seconds of `family`, with our fast paths on or off."""
    import torch

    from art_core.engine.config import EngineConfig
    from art_core.engine.torch.engine import TorchEngine
    from art_core.models.chat_template import render_prompt
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn
    from art_core.training.batch import prepare_batch
    from art_core.training.config import TrainConfig
    from art_core.training.trainer import Trainer

    loaded, model, tokenizer = _setup(family, folder)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Write a line about the sea."}])
    with fast_paths(fast):
        engine = TorchEngine(model, tokenizer, EngineConfig(serve_dtype=torch.float32, stop_on_eos=False))
        try:
            rounds = [
                asyncio.run(_decode_round(engine, prompt, args.tokens)) for _ in range(args.repeats + 1)
            ]
        finally:
            engine.close()
        completions = rounds[0][1]
        tokens = sum(len(c.token_ids) for c in completions)
        trajectories = [
            Trajectory(turns=[Turn(prompt_ids=prompt, completion_ids=c.token_ids, logprobs=c.logprobs)],
                       reward=float(i % 2 == 0))
            for i, c in enumerate(completions)
        ]  # fmt: skip
        prepared = prepare_batch(
            [TrajectoryGroup(trajectories)], scale_rewards=True, max_context=2048, vocab_size=len(tokenizer)
        )
        trainer = Trainer(
            model, pad_id=int(tokenizer.pad_token_id), adapter_name="live", config=TrainConfig()
        )
        steps = []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            trainer.train_step(prepared, TrainConfig(learning_rate=1e-5))
            steps.append(time.perf_counter() - started)
    return {
        "decode_tok_s": round(tokens / statistics.median([t for t, _ in rounds[1:]]), 1),
        "train_step_s": round(statistics.median(steps[1:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--only", default="", help="comma-separated family names (default: all)")
    args = parser.parse_args()
    import torch

    from tests.helpers_families import FAMILIES

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_header())
    print(
        f"torch threads {torch.get_num_threads()}; {ROWS} rows x {args.tokens} tokens; float32; shared machine"
    )
    wanted = set(filter(None, args.only.split(",")))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            if wanted and family.name not in wanted:
                continue
            row = measure(family, Path(tmp) / family.name, True, args)
            row["path"] = "fast" if family.fast else "transformers"
            if family.fast:
                peer = measure(family, Path(tmp) / f"{family.name}-peer", False, args)
                row["peer_transformers"] = peer
                row["decode_speedup"] = round(row["decode_tok_s"] / peer["decode_tok_s"], 2)
                row["train_speedup"] = round(peer["train_step_s"] / row["train_step_s"], 2)
            results[family.name] = row
            print(f"{family.name:10s} {json.dumps(row)}", flush=True)
    print(json.dumps({"bench": "families", "tokens": args.tokens, "rows": ROWS, "results": results}))


if __name__ == "__main__":
    main()
