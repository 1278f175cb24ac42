"""The whole loop through real parts: LocalBackend, our HTTP server, the openai client, GRPO.

The tiny random model learns a token-level task in a few steps, so these tests show that
rollouts -> trajectories -> train -> serve-the-new-LoRA really closes the loop, and that a
restarted run resumes exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_core.backends import LocalBackend
from art_core.training.config import LossConfig

MESSAGES = [{"role": "user", "content": "def main():"}]


def token_reward(trajectory: Trajectory, favoured: set[int]) -> float:
    ids = [t for turn in trajectory.turns for t in turn.completion_ids]
    return sum(t in favoured for t in ids) / max(len(ids), 1)


async def rollout(model: TrainableModel, favoured: set[int], seed: int | None = None) -> Trajectory:
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=MESSAGES, max_tokens=8, temperature=1.0, seed=seed
    )
    trajectory = Trajectory(messages_and_choices=[*MESSAGES, completion.choices[0]])
    trajectory.reward = token_reward(trajectory, favoured)
    return trajectory


async def run_steps(
    model: TrainableModel, favoured: set[int], steps: int, seeded: bool = False
) -> list[float]:
    rewards = []
    # A row's logits depend, by float rounding, on the rows it is decoded beside (~4e-6 in a
    # log-prob), and a seeded draw that lands that close to a token's edge in the CDF picks its
    # neighbour: step 2, group 0, row 6 here did, in ~1 of 4 runs on an Intel Xeon without AMX.
    # So seeded runs send their requests one at a time (every row decodes alone, whatever the
    # timing), and leave out the engine's log-probs (truncated importance sampling) all the same.
    loss = LossConfig(name="grpo", tis_cap=None if seeded else 2.0)
    config = TrainConfig(learning_rate=2e-2, loss=loss)  # both groups in one pass (the default packing)
    for _ in range(steps):
        step = await model.get_step()
        if seeded:
            groups = [
                TrajectoryGroup(
                    [await rollout(model, favoured, seed=1000 * step + 10 * g + i) for i in range(8)]
                )
                for g in range(2)
            ]
        else:
            groups = await gather_trajectory_groups(
                [TrajectoryGroup(rollout(model, favoured) for _ in range(8)) for _ in range(2)], pbar=False
            )
        rewards.append(sum(t.checked_reward() for g in groups for t in g) / 16)
        await model.train(groups, config=config)
    return rewards


@pytest.fixture
def favoured(tiny_model) -> set[int]:
    # A fixed set of 128 ordinary tokens (~6% of the vocabulary), so the start reward is low.
    special = set(tiny_model.tokenizer.all_special_ids)
    return {i for i in range(100, 2048, 15) if i not in special}


async def test_reward_rises_through_the_real_loop(tmp_path, favoured):
    model = TrainableModel(project="loop", name="tiny", base_model="tiny-random", lora_rank=8)
    backend = LocalBackend(tmp_path)
    await model.register(backend)
    try:
        rewards = await run_steps(model, favoured, steps=24)
        first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
        assert last > first + 0.3, rewards
        assert await model.get_step() == 24
        history = await model.history()
        assert len(history) == 24 and all("train/reward" in h for h in history)
        assert (tmp_path / "loop/models/tiny/trajectories/train/0024.jsonl").exists()
        # The latest weights are served under the plain name and under name@step.
        client = model.openai_client()
        names = {m.id for m in (await client.models.list()).data}
        assert {"tiny", "tiny@0", "tiny@24"} <= names
        old = await client.chat.completions.create(model="tiny@0", messages=MESSAGES, max_tokens=8, seed=1)
        assert old.choices[0].model_extra["token_ids"]
    finally:
        await backend.close()


async def test_restart_resumes_exactly(tmp_path, favoured):
    async def run(path, plan: list[int]) -> dict[str, torch.Tensor]:
        for steps in plan:
            model = TrainableModel(project="resume", name="m", base_model="tiny-random")
            backend = LocalBackend(path)
            await model.register(backend)
            await run_steps(model, favoured, steps=steps, seeded=True)
            hosted = backend.service.get("m")
            weights = {
                k: v.detach().clone() for k, v in hosted.trainer.model.named_parameters() if "lora_" in k
            }
            await backend.close()
        return weights

    straight = await run(tmp_path / "a", [3])
    resumed = await run(tmp_path / "b", [2, 1])
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    history = [
        json.loads(line) for line in (tmp_path / "b/resume/models/m/history.jsonl").read_text().splitlines()
    ]
    assert [h["step"] for h in history] == [1, 2, 3]


async def test_a_step_that_trains_nothing_says_so(tmp_path, caplog):
    model = TrainableModel(project="loop", name="flat", base_model="tiny-random")
    backend = LocalBackend(tmp_path)
    await model.register(backend)
    try:
        groups = await gather_trajectory_groups(
            [TrajectoryGroup(rollout(model, set()) for _ in range(4))], pbar=False
        )
        engine = backend.service.get("flat").engine
        merges = engine.stats().merges
        with caplog.at_level("WARNING"):
            result = await model.train(groups)
        assert not result.trained
        await gather_trajectory_groups([TrajectoryGroup(rollout(model, set()) for _ in range(2))], pbar=False)
        assert engine.stats().merges == merges  # the weights did not change: nothing was re-merged
        assert "1 of 1 groups had equal rewards" in result.warnings[0]
        assert "nothing trained" in caplog.text
        assert result.step == 1  # the step still advances: it is the data position of a resumed run
    finally:
        await backend.close()


async def test_bad_rewards_fail_loudly(tmp_path, favoured):
    model = TrainableModel(project="loop", name="bad", base_model="tiny-random")
    backend = LocalBackend(tmp_path)
    await model.register(backend)
    try:
        group = await TrajectoryGroup(rollout(model, favoured) for _ in range(2))
        group.trajectories[0].reward = float("nan")
        with pytest.raises(ValueError, match="finite"):
            await model.train([group])
        group.trajectories[0].reward = None
        with pytest.raises(ValueError, match="reward"):
            await model.train([group])
        assert await model.get_step() == 0
    finally:
        await backend.close()


def test_names_that_would_escape_storage_are_refused():
    for bad in ("../evil", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            TrainableModel(project="p", name=bad, base_model="tiny-random")
        with pytest.raises(ValueError):
            TrainableModel(project=bad, name="ok", base_model="tiny-random")


def test_non_loopback_backend_requires_an_api_key(tmp_path):
    with pytest.raises(ValueError, match="api_key"):
        LocalBackend(tmp_path, host="0.0.0.0")


async def test_registering_again_before_any_step_resumes_step_zero(tmp_path):
    for _ in range(2):
        model = TrainableModel(project="loop", name="again", base_model="tiny-random")
        backend = LocalBackend(tmp_path)
        await model.register(backend)
        assert await model.get_step() == 0
        await backend.close()
