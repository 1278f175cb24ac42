"""What a train step keeps for its backward pass, by the source line that saved it.

    python bench/saved_activations.py

Builds a batch shaped like one step of `art demo` (its system prompt and first four scenarios, 8
rollouts each of 24 sampled tokens, alternating rewards so every group trains), runs one warm-up
step, then one step under `torch.autograd.graph.saved_tensors_hooks`, and sums the distinct
storages the forward saved, by the innermost source line of our code (or torch's / peft's) that
saved each. Storages that are model parameters (the frozen base weights a matmul keeps a reference
to) are counted apart: they cost no memory. The last line is JSON:
`{"tokens", "micro_batches", "saved_mb", "parameters_mb", "activations_mb", "mb_per_token"}`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import traceback
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--group-pack-tokens", type=int, default=None, help="TrainConfig's (default: its default)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="source lines to list")
    args = parser.parse_args()

    import torch

    from art_core.app.demo import SCENARIOS, SYSTEM_PROMPT
    from art_core.models.loading import load_model
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn
    from art_core.training.batch import prepare_batch
    from art_core.training.config import LoRAConfig, TrainConfig
    from art_core.training.lora import attach_lora
    from art_core.training.trainer import Trainer

    print(machine_header())
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    rng = random.Random(0)
    groups = []
    for scenario in SCENARIOS[:4]:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": scenario}]
        rendered: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        rollouts = []
        for index in range(8):
            completion = [rng.randrange(100, 20000) for _ in range(24)]
            turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion))
            rollouts.append(Trajectory(turns=[turn], reward=float(index % 2 == 0)))
        groups.append(TrajectoryGroup(rollouts))
    batch = prepare_batch(groups, scale_rewards=True, max_context=loaded.max_context)
    model = attach_lora(loaded.model, LoRAConfig(r=16, alpha=16))
    config = TrainConfig(learning_rate=3e-4)
    if args.group_pack_tokens is not None:
        config = TrainConfig(learning_rate=3e-4, group_pack_tokens=args.group_pack_tokens)
    trainer = Trainer(model, pad_id=tokenizer.pad_token_id, config=config)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by_line: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    weights = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal weights
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            return tensor
        seen.add(key)
        if key in parameters:
            weights += storage.nbytes()
            return tensor
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if any(part in f.filename for part in ("art_core", "torch/nn", "peft"))
        ]
        frame = frames[-1] if frames else traceback.extract_stack()[-2]
        by_line[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"] += storage.nbytes()
        return tensor

    trainer.train_step(batch)  # warm-up
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        metrics = trainer.train_step(batch)
    tokens = int(sum(len(t.turns[0].prompt_ids) + 24 for g in groups for t in g.trajectories))
    activations = sum(by_line.values())
    print(
        f"batch: 4 groups x 8 rollouts, {tokens} tokens unpacked, {_packed_tokens(batch)} packed; "
        f"{metrics['micro_batches']:.0f} pass(es)"
    )
    for line, size in by_line.most_common(args.top):
        print(f"{size / MB:9.1f} MB  {line}")
    print(f"{activations / MB:9.1f} MB  activations in all; {weights / MB:.1f} MB of parameters referenced")
    packed = _packed_tokens(batch)
    print(
        json.dumps(
            {
                "tokens": packed,
                "micro_batches": int(metrics["micro_batches"]),
                "saved_mb": round((activations + weights) / MB, 1),
                "parameters_mb": round(weights / MB, 1),
                "activations_mb": round(activations / MB, 1),
                "mb_per_token": round(activations / MB / packed, 3),
            }
        )
    )


def _packed_tokens(batch: Any) -> int:
    """The tokens one pass over all of the batch's groups computes (`batch.packed_tokens`: a common
    prefix and each group's prompt once)."""
    from art_core.training.batch import packed_tokens

    groups: dict[int, list[Any]] = {}
    for example in batch.examples:
        groups.setdefault(example.group_index, []).append(example)
    return packed_tokens(list(groups.values()))


if __name__ == "__main__":
    main()
