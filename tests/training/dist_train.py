"""K training steps of the tiny model, run by the distributed tests: one process, or one rank of
`torchrun --nproc-per-node N` (gloo). Rank 0 writes the final LoRA weights and metrics to --out.

Halfway, rank 0 writes a checkpoint atomically (ModelStorage), every rank wipes its LoRA and
optimizer and resumes from that checkpoint's files as rank 0 broadcasts them, so the resume
path is part of what the equivalence test compares.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from art_core.models.loading import load_model
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.storage import ModelStorage
from art_core.training.batch import PreparedBatch, prepare_batch
from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
from art_core.training.distributed import (
    World,
    barrier,
    broadcast_files,
    close_world,
    init_world,
    shard_base_linears,
    world_from_env,
)
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer

CONFIG = TrainConfig(
    learning_rate=1e-2,
    micro_batch_tokens=40,  # several micro-batches per group, so the ranks' shares are uneven
    matmul_precision="ieee",
    loss=LossConfig(name="grpo", kl_coef=0.1),
)


def make_batch(seed: int, groups: int = 3, size: int = 4) -> PreparedBatch:
    """Random prompts and completions of varied lengths, rewards alternating 1/0 in each group."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=generator).tolist()

    result = []
    for _ in range(groups):
        prompt = ids(6)
        trajectories = []
        for i in range(size):
            completion = ids(3 + 2 * i)
            turn = Turn(
                prompt_ids=prompt, completion_ids=completion, logprobs=[float("nan")] * len(completion)
            )
            trajectories.append(Trajectory(turns=[turn], reward=float(i % 2)))
        result.append(TrajectoryGroup(trajectories))
    return prepare_batch(result, scale_rewards=True, max_context=2048)


def resume_from_checkpoint(trainer: Trainer, world: World | None, storage: ModelStorage, step: int) -> None:
    """Rank 0 writes the checkpoint; every rank forgets its state and loads rank 0's files."""
    if world is None or world.is_main:
        storage.write_checkpoint(step, trainer.save_state)
    with torch.no_grad():
        for param in trainer.params:
            param.zero_()
    trainer.optimizer.state.clear()
    if world is None:
        trainer.load_state(storage.checkpoint_dir(step))
        return
    source = storage.checkpoint_dir(step) if world.is_main else None
    local = storage.root / f"rank{world.rank}-step{step}"
    trainer.load_state(broadcast_files(source, world, local))
    barrier(world)


def record_grad_scales(trainer: Trainer) -> dict[int, float]:
    """The largest |gradient| of each LoRA tensor as AdamW sees it (after clipping), per step."""
    scales: dict[int, float] = {}

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for index, param in enumerate(trainer.params):
            scales[index] = float(param.grad.abs().max()) if param.grad is not None else 0.0

    trainer.optimizer.register_step_pre_hook(hook)
    return scales


def add_update_bound(trainer: Trainer, bound: dict[str, torch.Tensor], scales: dict[int, float]) -> None:
    """Add this step's float-rounding bound on each LoRA weight's AdamW update to `bound`.

    Two correct computations of a step's gradient differ by at most `tau`, the rounding
    tolerance of the model's forward and backward at the gradient's scale (bounded by its L2
    magnitude in that tensor). AdamW's update lr * m / (sqrt(v) + eps) moves by at most 2 * lr * tau / (sqrt(v) + eps)
    for a perturbation tau of the gradients it averages (m by tau, sqrt(v) by tau, and |m| <=
    sqrt(v)): large where an element's gradients are tiny, as AdamW normalises them. Summed over
    the steps; to first order (the later steps' gradients also move with the weights, which
    SAFETY covers at this learning rate and K).
    """
    from tests.tolerances import model_tolerance

    lr, beta2 = trainer.config.learning_rate, trainer.config.adam_betas[1]
    group = trainer.optimizer.param_groups[0]
    for index, (name, param) in enumerate(zip(trainer.param_names, trainer.params, strict=True)):
        tau = model_tolerance(trainer.model, torch.float32, scale=scales[index], backward=True)
        state = trainer.optimizer.state[param]
        step = float(state["step"])
        v_hat = state["exp_avg_sq"] / (1 - beta2**step)
        bound[name] += 2 * lr * tau / (v_hat.sqrt() + group["eps"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = world_from_env(os.environ, cuda=False)
    if world is not None:
        init_world(world, timeout_s=120)
    torch.manual_seed(0)
    model = attach_lora(load_model("tiny-random").model, LoRAConfig(r=4, alpha=8))
    if args.fsdp:
        if world is None or shard_base_linears(model, world) == 0:
            raise SystemExit("--fsdp needs several ranks and a model with decoder Linear layers")
    trainer = Trainer(model, pad_id=0, config=CONFIG, world=world, lockstep=args.fsdp)
    generator = torch.Generator().manual_seed(1)  # LoRA B starts at 0; exercise every weight
    with torch.no_grad():
        for param in trainer.params:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    storage = ModelStorage.create(args.out / "art", "dist", "tiny")
    metrics = []
    bound = {name: torch.zeros_like(p) for name, p in zip(trainer.param_names, trainer.params, strict=True)}
    scales = record_grad_scales(trainer)
    for step in range(args.steps):
        metrics.append(trainer.train_step(make_batch(seed=step)))
        add_update_bound(trainer, bound, scales)
        if step == args.steps // 2 - 1 or (args.steps == 1 and step == 0):
            resume_from_checkpoint(trainer, world, storage, step + 1)
    if world is None or world.is_main:
        weights = {
            n: p.detach().contiguous() for n, p in zip(trainer.param_names, trainer.params, strict=True)
        }
        save_file(weights, str(args.out / "lora.safetensors"))
        save_file(bound, str(args.out / "bound.safetensors"))
        (args.out / "metrics.json").write_text(json.dumps(metrics))
    close_world()


if __name__ == "__main__":
    main()
