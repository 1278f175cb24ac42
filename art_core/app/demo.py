"""The built-in demo task: a fruit stand's assistant learns to recommend bananas.

It is written the way a user writes any task: a rollout function that talks to the model
through the OpenAI client, a reward function, and the gather -> train loop. The reward is
1.0 when the reply recommends bananas and 0.0 otherwise; SmolLM2-135M-Instruct does so
rarely at first, so a rising curve is learning, not luck.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_core.backends.local import LocalBackend
from art_core.host.step_record import overlapped_checkpoint_seconds
from art_core.model import TrainableModel
from art_core.rollouts.dataset import iterate_dataset
from art_core.rollouts.groups import TrajectoryGroup, gather_trajectory_groups
from art_core.rollouts.records import Trajectory
from art_core.training.config import TrainConfig

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are the friendly assistant of a fruit stand. Answer in one short sentence."
SCENARIOS = [
    "Which fruit should I buy today?",
    "Recommend a fruit for my breakfast.",
    "What is a good snack to take on a hike?",
    "I need a fruit for a smoothie. Any suggestion?",
    "What fruit would you give a child?",
    "Suggest one fruit that is easy to peel.",
    "What should I eat before going for a run?",
    "Which fruit goes well with cereal?",
]


def reward(reply: str) -> float:
    """1.0 if the reply mentions bananas, else 0.0."""
    return 1.0 if "banana" in reply.lower() else 0.0


async def rollout(
    model: TrainableModel, scenario: str, max_tokens: int, seed: int | None = None
) -> Trajectory:
    """One conversation with the model being trained, scored by `reward`; `seed` seeds its sampling."""
    started = time.time()  # the trajectory's start: its step's `time/rollout_s` counts from the earliest
    client = model.openai_client()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": scenario}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, temperature=1.0, seed=seed
    )
    choice = completion.choices[0]
    return Trajectory(
        messages_and_choices=[*messages, choice],
        reward=reward(choice.message.content or ""),
        metadata={"scenario": scenario},
        start_time=started,
    )


@dataclass(frozen=True)
class DemoConfig:
    """Settings of `art demo`."""

    base_model: str = "smollm2-135m"
    """The model to train (alias, local folder, .gguf file or cached hub id)."""
    steps: int = 30
    """Training steps."""
    scenarios_per_step: int = 4
    """Groups per step."""
    group_size: int = 8
    """Rollouts per scenario; GRPO compares them with each other."""
    max_tokens: int = 24
    """Tokens per reply."""
    learning_rate: float = 3e-4
    """LoRA learning rate."""
    lora_rank: int = 16
    """LoRA rank."""
    path: Path = Path(".art")
    """Where checkpoints, history and trajectories go."""
    name: str = "demo-001"
    """The model's name (a folder under `<path>/demo/models/`)."""
    seed: int = 0
    """Seed of the scenario order and of every rollout's sampling (`rollout_seed`): two runs with
    the same seed draw the same replies for as long as their weights are the same."""

    def __post_init__(self) -> None:
        for field_name in ("steps", "scenarios_per_step", "group_size", "max_tokens", "lora_rank"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: GRPO needs at least two rollouts to compare")


@dataclass(frozen=True)
class DemoSummary:
    """Mean reward of the first and last steps (up to 5 each), steps run, wall time and its split."""

    first_reward: float
    last_reward: float
    steps: int
    seconds: float
    rewards: list[float]
    start_step: int = 0
    """The step the model was at before this run (> 0: it resumed an existing model)."""
    step_seconds: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step of this run, from history.jsonl (`step_time_split`)."""


SPLIT_PHASES = ("rollout", "remerge", "train", "publish", "checkpoint", "checkpoint_wait", "step")
"""The `time/<phase>_s` keys of a train line that `step_time_split` averages."""


def step_time_split(history: Sequence[Mapping[str, Any]], after_step: int = 0) -> dict[str, float]:
    """Mean seconds per step of the train lines past `after_step`: each of `SPLIT_PHASES` a line has
    (`checkpoint_wait` only with the background commit), and `checkpoint_overlapped`: the part of a
    step's checkpoint written during the next step's rollouts (`overlapped_checkpoint_seconds`)."""
    lines = [h for h in history if "trained" in h and int(h["step"]) > after_step]
    if not lines:
        return {}
    split = {
        phase: statistics.fmean(float(h.get(f"time/{phase}_s", 0.0)) for h in lines)
        for phase in SPLIT_PHASES
        if any(f"time/{phase}_s" in h for h in lines)
    }
    if "checkpoint_wait" in split:
        split["checkpoint_overlapped"] = overlapped_checkpoint_seconds(lines)[1] / len(lines)
    return split


def describe_split(split: Mapping[str, float]) -> str:
    """One line: `per step: rollouts 4.2 s, train 3.5 s, ... checkpoint 1.2 s (1.1 s overlapped ...)`."""
    if not split:
        return "per step: no train step recorded"
    names = {"rollout": "rollouts", "train": "train", "publish": "publish", "checkpoint": "checkpoint"}
    notes = (
        {"publish": f" (the served weights' re-merge {split['remerge']:.2f} s)"} if "remerge" in split else {}
    )
    parts = [
        f"{label} {split[key]:.2f} s{notes.get(key, '')}" for key, label in names.items() if key in split
    ]
    if "checkpoint_overlapped" in split:
        parts[-1] += (
            f" ({split['checkpoint_overlapped']:.2f} s of it during the next rollouts; "
            f"train waited {split.get('checkpoint_wait', 0.0):.2f} s for it)"
        )
    elif "checkpoint" in split:
        parts[-1] += " (inside the train call)"
    return f"per step: {', '.join(parts)}; train call {split.get('step', 0.0):.2f} s"


def rollout_seed(seed: int, step: int, group: int, index: int) -> int:
    """The sampling seed of rollout `index` of group `group` at step `step` of a run seeded `seed`:
    distinct for every rollout of a run, the same for the same rollout of another run (the engine's
    `row_seed` mixing, once per level; +1 since its index 0 keeps the seed as it is)."""
    from art_core.engine.sampling import row_seed  # torch: imported when the demo runs

    return row_seed(row_seed(row_seed(seed, step + 1), group + 1), index + 1)


StepCallback = Callable[[int, float, float], None]
"""Called after each step with (step index, mean reward, seconds so far)."""


async def run_demo(config: DemoConfig, on_step: StepCallback | None = None) -> DemoSummary:
    """Train `config.base_model` on the fruit-stand task and return the reward summary."""
    started = time.perf_counter()
    model = TrainableModel(
        project="demo", name=config.name, base_model=config.base_model, lora_rank=config.lora_rank
    )
    from art_core.engine.config import EngineConfig  # torch: imported when the demo runs

    # "head": where the adapter is served merged (a bf16 copy), only the head's decode weight is
    # packed: every LoRA step re-merges the other weights (and would repack them), and packing them
    # all costs ~0.5 GB of the demo's 3 GB. Where it is served unmerged (float32 on a CPU where bf16
    # does not pay, `EngineConfig.serve_unmerged`), every base weight is packed, with the LoRA update
    # merged into the same buffers after each step, in the merged copy's place (docs/benchmarks.md,
    # "`art demo`"). No prefix cache: each step's new weights
    # empty it before the next step's prompts could hit, and the rows of a step share their
    # prompts' prefill by themselves; it held ~90 MB at the train step's peak.
    backend = LocalBackend(config.path, engine_config=EngineConfig(pack_weights="head", prefix_cache_mib=0))
    rewards: list[float] = []
    start_step = 0
    try:
        await model.register(backend)
        train_config = TrainConfig(learning_rate=config.learning_rate)
        start_step = await model.get_step()
        batches = iterate_dataset(
            SCENARIOS,
            groups_per_step=config.scenarios_per_step,
            num_epochs=10**6,
            initial_step=start_step,
            seed=config.seed,
        )
        for batch in batches:
            if batch.step >= start_step + config.steps:
                break
            groups = await gather_trajectory_groups(
                (
                    TrajectoryGroup(
                        rollout(model, s, config.max_tokens, rollout_seed(config.seed, batch.step, g, i))
                        for i in range(config.group_size)
                    )
                    for g, s in enumerate(batch.items)
                ),
                pbar=False,
            )
            step_rewards = [t.checked_reward() for g in groups for t in g.trajectories]
            rewards.append(sum(step_rewards) / len(step_rewards))
            await model.train(groups, config=train_config)
            if on_step is not None:
                on_step(len(rewards), rewards[-1], time.perf_counter() - started)
        split = step_time_split(await model.history(), after_step=start_step)  # waits for the last commit
    finally:
        await backend.close()
    window = min(5, len(rewards))
    return DemoSummary(
        first_reward=sum(rewards[:window]) / max(window, 1),
        last_reward=sum(rewards[-window:]) / max(window, 1),
        steps=len(rewards),
        seconds=time.perf_counter() - started,
        rewards=rewards,
        start_step=start_step,
        step_seconds=split,
    )
