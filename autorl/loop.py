"""The training loop over items: rollouts, scoring (RULER by default), one GRPO step, resume.

`train_loop` runs until the model reaches `LoopConfig.steps`. Each step takes
`groups_per_step` items (a deterministic shuffle per epoch, `art_core.iterate_dataset`), runs
`group_size` rollouts of each through the caller's `rollout(item)`, scores each finished group
with the caller's `score(group)` (a copy with rewards; RULER sets `metrics["ruler_errors"]` on
failure), trains on the groups that were scored, and appends one record to `history.jsonl`.

Resume: the model's step is the data position (`TrainableModel.train` advances it on every call,
also when a step trains nothing or every group failed), so a rerun continues with the next
batch. `loop.json` records that position, the item count and a hash of the item ids after each
step; a rerun with other items warns. History rows past the model's step (a step whose
checkpoint never landed) are dropped on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from art_core import (
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    iterate_dataset,
)
from art_core.atomic import atomic_write_bytes
from autorl.ruler import scored_groups

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Rollout = Callable[[Item], Awaitable[Trajectory]]
"""One rollout of an item; the reward may stay unset (the scorer sets it)."""
Scorer = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]]
"""A finished group in, a scored copy out (e.g. `ruler_score_group(g, judge, on_error="count")`)."""
StepCallback = Callable[[dict[str, Any]], None]
"""Called after each step with its history record."""


@dataclass(frozen=True)
class LoopConfig:
    """How many steps, how big, and how each step trains."""

    steps: int
    """Train until the model is at this step (a resumed run does only the missing ones)."""
    groups_per_step: int = 2
    """Items per step; each becomes one group."""
    group_size: int = 4
    """Rollouts per item, compared with each other by the scorer and GRPO."""
    seed: int = 0
    """Seed of the item order (the same seed resumes at the same data position)."""
    max_rollout_failures: float = 0.5
    """Failed rollouts tolerated per step: a count >= 1, or a fraction in (0, 1) of the step's rollouts."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(learning_rate=1e-4))
    """What each GRPO step does (learning rate, loss...)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (GRPO compares rollouts of one item), got {self.group_size}"
            )
        if not (self.max_rollout_failures >= 0 and math.isfinite(self.max_rollout_failures)):
            raise ValueError(f"max_rollout_failures must be >= 0, got {self.max_rollout_failures}")


@dataclass
class _StepTimes:
    started: float = field(default_factory=time.perf_counter)
    rollouts_s: float = 0.0
    train_s: float = 0.0


def items_hash(ids: Sequence[str]) -> str:
    """A short hash of the item ids, in order; pure."""
    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:16]


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records of `history.jsonl` (missing file: none); a torn last line is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            logger.warning("skipping an unreadable line of %s", path)
    return rows


def _append_line(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, value: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=1) + "\n").encode("utf-8"))


def reward_stats(groups: Sequence[TrajectoryGroup]) -> dict[str, float | None]:
    """Mean, std, min and max of the rewards of `groups` (None when there are none); pure."""
    rewards = [t.reward for g in groups for t in g.trajectories if t.reward is not None]
    if not rewards:
        return {"reward": None, "reward_std": None, "reward_min": None, "reward_max": None}
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return {"reward": mean, "reward_std": std, "reward_min": min(rewards), "reward_max": max(rewards)}


def _resume(state_dir: Path, position: int, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The history up to `position`, rewritten without later rows; warns when the items changed."""
    history_path = state_dir / "history.jsonl"
    history = read_history(history_path)
    kept = [row for row in history if int(row.get("step", 0)) <= position]
    if len(kept) != len(history):
        logger.warning(
            "dropping %d history rows past the model's step %d", len(history) - len(kept), position
        )
        history_path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    state_path = state_dir / "loop.json"
    if state_path.is_file():
        state = json.loads(state_path.read_text(encoding="utf-8"))
        if state.get("items_hash") != items_hash(ids):
            logger.warning(
                "the training items changed since this run started (%s items, now %d); the data position "
                "continues by step number",
                state.get("items"),
                len(ids),
            )
    return kept


async def train_loop(
    model: TrainableModel,
    items: Sequence[Item],
    *,
    rollout: Rollout[Item],
    score: Scorer,
    config: LoopConfig,
    state_dir: Path,
    item_id: Callable[[Item], str] = str,
    on_step: StepCallback | None = None,
) -> list[dict[str, Any]]:
    """Train `model` on `items` until `config.steps`; returns every history record of the run."""
    if not items:
        raise ValueError("train_loop got no items to train on")
    state_dir.mkdir(parents=True, exist_ok=True)
    ids = [item_id(i) for i in items]
    position = await model.get_step()
    history = _resume(state_dir, position, ids)
    if position >= config.steps:
        return history
    batches = iterate_dataset(
        list(items),
        groups_per_step=config.groups_per_step,
        num_epochs=10**6,
        initial_step=position,
        seed=config.seed,
    )
    for batch in batches:
        if batch.step >= config.steps:
            break
        record = await _one_step(model, batch.items, rollout, score, config)
        record["epoch"] = batch.epoch
        history.append(record)
        await model.get_step()  # the step's commit is on disk before the run's history says it is done
        _append_line(state_dir / "history.jsonl", record)
        _write_json(
            state_dir / "loop.json",
            {
                "position": record["step"],
                "items": len(ids),
                "items_hash": items_hash(ids),
                "seed": config.seed,
            },
        )
        if on_step is not None:
            on_step(record)
    return history


async def _one_step(
    model: TrainableModel, items: Sequence[Any], rollout: Rollout[Any], score: Scorer, config: LoopConfig
) -> dict[str, Any]:
    times = _StepTimes()
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(rollout(item) for _ in range(config.group_size)) for item in items),
        pbar=False,
        max_exceptions=config.max_rollout_failures,
        after_each=score,
    )
    times.rollouts_s = time.perf_counter() - times.started
    ok, judge_errors = scored_groups(groups)
    ok = [g for g in ok if g.trajectories and all(t.reward is not None for t in g.trajectories)]
    started_train = time.perf_counter()
    result = await model.train(ok, config=config.train)
    times.train_s = time.perf_counter() - started_train
    rollout_errors = sum(len(g.exceptions) for g in groups)
    return {
        "step": result.step,
        **reward_stats(ok),
        "groups": len(groups),
        "groups_scored": len(ok),
        "judge_errors": judge_errors,
        "judge_calls": sum(int(g.metrics.get("ruler_attempts", 0)) for g in ok),
        "rollout_errors": rollout_errors,
        "trained": result.trained,
        "warnings": result.warnings,
        "rollouts_s": times.rollouts_s,
        "train_s": times.train_s,
        "step_s": time.perf_counter() - times.started,
    }


__all__ = ["LoopConfig", "Rollout", "Scorer", "items_hash", "read_history", "reward_stats", "train_loop"]
