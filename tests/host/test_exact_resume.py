"""Exact resume (issue 18 item 3): two steps in one process, and the same two steps with the service
closed and rebuilt from disk in between (what a kill and a restart do), give the same checkpoint 2
bit for bit: LoRA weights, AdamW state (moments and step counts) and the torch RNG state.

What must be seeded for this to hold end to end (docs/reliability.md):
- the LoRA init: `LoRAConfig.seed` (default 0, applied by `attach_lora`);
- the trainer's RNG (LoRA dropout): saved in every checkpoint and restored on resume (`rng.safetensors`);
- the data position: the model's step (`get_step()`), which advances once per committed step;
- the rollouts: the sampling `seed` of each chat request (per request, e.g. from step and index);
  unseeded sampling differs run to run, so the groups, and thus the training, differ.
Here the groups are fixed token records, so the rollouts are out of the picture; the test holds the
trainer to bit-for-bit equality on CPU with the same thread count (no tolerance needed: the same
operations run in the same order on the same inputs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from art_core.host.records import ModelSpec
from art_core.host.service import ModelService
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.training.config import TrainConfig
from art_core.training.lora import LoRAConfig

CONFIG = TrainConfig(learning_rate=1e-2)
SPEC = ModelSpec(name="agent", project="exact", base_model="tiny-random", lora=LoRAConfig(dropout=0.1))


def groups(step: int) -> list[TrajectoryGroup]:
    """Two groups of three fixed completions with rewards 0, 0.5, 1 (different per step)."""

    def trajectory(group: int, index: int) -> Trajectory:
        turn = Turn(
            prompt_ids=[5 + step, 17 + group, 40, 41],
            completion_ids=[100 + index, 7 * (step + index) % 90 + 10, 3],
            logprobs=[-1.0, -2.0, -0.5],
        )
        return Trajectory(messages=[{"role": "user", "content": "x"}], turns=[turn], reward=index / 2)

    return [TrajectoryGroup([trajectory(g, i) for i in range(3)]) for g in range(2)]


async def train_steps(base: Path, steps: list[int]) -> None:
    service = ModelService(base)
    try:
        service.register(SPEC)
        for step in steps:
            result = await service.train(SPEC.name, groups(step), CONFIG)
            assert result.trained and result.step == step, result.warnings
    finally:
        service.close()


def state(base: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    folder = base / "exact" / "models" / "agent" / "checkpoints" / f"{step:04d}"
    names = ("adapter_model.safetensors", "optimizer.safetensors", "rng.safetensors")
    return {name: load_file(str(folder / name)) for name in names}


async def test_interrupted_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    await train_steps(straight, [1, 2])
    await train_steps(resumed, [1])
    await train_steps(resumed, [2])  # a new service: loads checkpoint 1 (weights, AdamW, RNG), trains step 2
    a, b = state(straight, 2), state(resumed, 2)
    for name in a:
        assert a[name].keys() == b[name].keys() and a[name], name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"{name}:{key} differs after resume"
    assert state(straight, 1)["adapter_model.safetensors"] != {}  # step 1 moved the weights from step 0
    before, after = state(straight, 0)["adapter_model.safetensors"], a["adapter_model.safetensors"]
    assert any(not torch.equal(before[k], after[k]) for k in before)
