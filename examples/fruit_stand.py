"""The `art demo` task as a library script: the training loop a user writes around a rollout.

The task itself (`rollout`, which calls the model through its OpenAI client, and `reward`) lives
in `art_core.app.demo`; read it there. This script shows the loop: register, gather groups of
rollouts, train, resume where a previous run stopped.

    python examples/fruit_stand.py --steps 30
    python examples/fruit_stand.py --base-model tiny-random --steps 2   # a quick smoke run
"""

from __future__ import annotations

import argparse
import asyncio

from art_core import TrainableModel, TrainConfig, TrajectoryGroup, gather_trajectory_groups, iterate_dataset
from art_core.app import SCENARIOS, rollout
from art_core.backends import LocalBackend


async def main(base_model: str, steps: int, group_size: int, path: str) -> list[float]:
    model = TrainableModel(project="examples", name="fruit-stand", base_model=base_model, lora_rank=16)
    backend = LocalBackend(path)
    await model.register(backend)
    rewards: list[float] = []
    start = await model.get_step()  # a resumed run continues with the next batch of scenarios
    for batch in iterate_dataset(SCENARIOS, groups_per_step=4, num_epochs=100, initial_step=start):
        if batch.step >= start + steps:
            break
        groups = await gather_trajectory_groups(
            TrajectoryGroup(rollout(model, scenario, max_tokens=24) for _ in range(group_size))
            for scenario in batch.items
        )
        result = await model.train(groups, config=TrainConfig(learning_rate=3e-4))
        rewards.append(result.metrics["train/reward"])
        print(f"step {result.step}: reward {rewards[-1]:.2f} trained={result.trained}")
    await backend.close()
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.base_model, args.steps, args.group_size, args.path))
