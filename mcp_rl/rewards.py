"""Rewards: RULER over each group, combined with the scenario's check where it has one.

    reward = check_weight * passed + (1 - check_weight) * ruler_score      (checkable scenarios)
    reward = ruler_score                                                   (others)

With `check_weight > 0.5` (default 0.7) a trajectory whose answer passes the check always scores
above one whose answer fails, whatever RULER says; RULER orders the trajectories within each class
(efficiency, partial progress, fewer tool errors). `--judge none` scores by the check alone
(every scenario must then have one).

Failures are never a silent zero: when RULER fails on a group, a checkable group is scored by the
check alone and counted (`metrics["ruler_errors"] = 1`, a line in `group.logs`); a group with no
check is left unscored (rewards None, `ruler_errors = 1`) and dropped before training, counted.
Trajectories whose server crashed or hung are taken out of their group before scoring
(`split_failed`); they are counted and kept for the report, not trained on.
"""

from __future__ import annotations

import logging

from art_core.types import Trajectory, TrajectoryGroup
from autorl.judge import JudgeConfig
from autorl.ruler import ruler_score_group
from mcp_rl.scenarios import Scenario, check_answer

logger = logging.getLogger(__name__)

RUBRIC = """\
- The agent must complete the user's task with the tools and end by calling complete_task with a final answer.
- An answer supported by the tool results scores far above one that is guessed, wrong, or missing.
- Give partial credit for real progress: the right tool called with the right arguments.
- Among equally good trajectories, fewer turns, fewer failed tool calls and a clearer answer score higher."""
"""The grading standards RULER is given for MCP agents."""


def split_failed(group: TrajectoryGroup) -> tuple[TrajectoryGroup, list[Trajectory]]:
    """The group without trajectories whose server failed, and those trajectories."""
    failed = [t for t in group.trajectories if t.metrics.get("server_failure")]
    kept = [t for t in group.trajectories if not t.metrics.get("server_failure")]
    return group.model_copy(update={"trajectories": kept}), failed


def mark_success(group: TrajectoryGroup, scenario: Scenario) -> None:
    """Set `metrics["success"]` (checkable scenarios only) from each trajectory's final answer."""
    for trajectory in group.trajectories:
        passed = check_answer(scenario, _answer(trajectory))
        if passed is not None:
            trajectory.metrics["success"] = passed


def _answer(trajectory: Trajectory) -> str | None:
    answer = trajectory.metadata.get("answer")
    return answer if isinstance(answer, str) else None


async def score_group(
    group: TrajectoryGroup,
    scenario: Scenario,
    judge: JudgeConfig | str | None,
    *,
    check_weight: float = 0.7,
) -> TrajectoryGroup:
    """A scored copy of `group` (see the module docstring); `judge=None` uses the check alone."""
    if not 0 <= check_weight <= 1:
        raise ValueError(f"check_weight must be in [0, 1], got {check_weight}")
    mark_success(group, scenario)
    if judge is None:
        if not scenario.checkable:
            raise ValueError(
                f"scenario {scenario.id} has no expected answer; --judge none needs one on every scenario"
            )
        scored = group.model_copy(deep=True)
        for trajectory in scored.trajectories:
            trajectory.reward = float(bool(trajectory.metrics["success"]))
        return scored
    scored = await ruler_score_group(group, judge, RUBRIC, on_error="count")
    failed = bool(scored.metrics.get("ruler_errors"))
    if scenario.checkable:
        for trajectory in scored.trajectories:
            passed = float(bool(trajectory.metrics["success"]))
            ruler = trajectory.metrics.get("ruler_score")
            trajectory.reward = (
                passed
                if failed or ruler is None
                else check_weight * passed + (1 - check_weight) * float(ruler)
            )
        if failed:
            scored.logs.append(
                f"scenario {scenario.id}: RULER failed, so this group is scored by its check alone"
            )
    return scored


def trainable(group: TrajectoryGroup) -> bool:
    """Whether every trajectory of the group has a reward and there are at least two."""
    return len(group.trajectories) >= 2 and all(t.reward is not None for t in group.trajectories)


__all__ = ["RUBRIC", "mark_success", "score_group", "split_failed", "trainable"]
