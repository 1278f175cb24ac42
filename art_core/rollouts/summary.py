"""Summary metrics of a split's trajectory groups, as `model.log` writes them to history.jsonl."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def split_metrics(groups: Iterable[TrajectoryGroup], split: str) -> dict[str, float]:
    """`{split}/reward`, `/reward_std_dev` (mean within-group population std), `/exception_rate`,
    `/num_trajectories`, `/num_groups`, the mean of each trajectory metric, as ART logs them, and
    the groups' metrics (`group_metrics`: RULER's judge calls and errors).

    Trajectories without a reward are left out of the reward means (and counted in
    `{split}/unrewarded`), never counted as 0.
    """
    groups = list(groups)
    trajectories: list[Trajectory] = [t for g in groups for t in g.trajectories]
    rewards = [float(t.reward) for t in trajectories if t.reward is not None]
    stds = [
        statistics.pstdev(r)
        for g in groups
        if len(r := [float(t.reward) for t in g.trajectories if t.reward is not None]) > 1
    ]
    exceptions = sum(len(g.exceptions) for g in groups)
    out = {
        f"{split}/reward": _mean(rewards),
        f"{split}/reward_std_dev": _mean(stds),
        f"{split}/exception_rate": exceptions / max(exceptions + len(trajectories), 1),
        f"{split}/num_trajectories": float(len(trajectories)),
        f"{split}/num_groups": float(len(groups)),
        f"{split}/unrewarded": float(len(trajectories) - len(rewards)),
    }
    names = sorted({k for t in trajectories for k in t.metrics})
    for name in names:
        out[f"{split}/{name}"] = _mean([float(t.metrics[name]) for t in trajectories if name in t.metrics])
    out.update(group_metrics(groups, split))
    return out


_SUMMED_GROUP_METRICS = (
    "judge_calls",
    "judge_errors",
    "ruler_errors",
    "ruler_attempts",
    "after_each_errors",
    "server_failures",
)
"""Group metrics that are counts, summed over the groups, not averaged: RULER's (`autorl.ruler`),
the gather's failed `after_each` calls, and rollouts whose tool server failed (`mcp_rl.rewards.split_failed`)."""


def group_metrics(groups: list[TrajectoryGroup], split: str) -> dict[str, float]:
    """`{split}/judge_calls`, `/judge_errors`, `/ruler_errors`, `/after_each_errors`, `/server_failures`
    summed over the groups that hold them,
    and `{split}/group_<name>` (ART's name) for the mean of every other group metric."""
    out: dict[str, float] = {}
    for name in sorted({k for g in groups for k in g.metrics}):
        values = [float(g.metrics[name]) for g in groups if name in g.metrics]
        if name in _SUMMED_GROUP_METRICS:
            out[f"{split}/{name}"] = sum(values)
        else:
            out[f"{split}/group_{name}"] = _mean(values)
    return out
