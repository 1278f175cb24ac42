"""Rewards: a shaped check (partial credit) where a scenario has an expected answer, plus RULER.

    reward = check_weight * credit + (1 - check_weight) * ruler_score      (checkable scenarios)
    reward = ruler_score                                                   (others)

`credit` is 1.0 when the final answer passes the scenario's check. Otherwise it is partial credit
for the steps that lead to a passing answer, which a small model reaches long before it passes
(a group in which every answer fails would otherwise have one reward for all and train nothing):

| part        | weight | earned when                                                              |
|-------------|--------|--------------------------------------------------------------------------|
| `completed` | 0.10   | the rollout ended with complete_task and a non-empty answer               |
| `tool_ok`   | 0.05   | at least one server tool call returned a result (not an error)            |
| `found`     | 0.25   | a tool result holds the expected answer (the agent looked up the right fact) |
| `typed`     | 0.05   | the answer is of the expected kind (holds a number, for a "number" check) |
| `close`     | 0.05   | "number" checks: 0.05 * max(0, 1 - |answer - expected| / max(|expected|, 1)), nearest number |

`typed` and `close` count only after a successful tool call: in the first measured run (without
that gate) SmolLM2 learned to skip the look-ups and end at once with some number, which earned the
answer-form credit more cheaply (docs/benchmarks.md).

`found` weighs most because looking up the right fact is the step a small model misses: in run 4
(docs/benchmarks.md), with `close` at 0.15 and `found` at 0.10, SmolLM2 learned to call
ship_order or receive_delivery on the named product, whose results are numbers near the stock,
and to answer with them; a near number then paid more than the right look-up. Now the right
look-up alone (0.05 + 0.25) outweighs a completed answer near the truth from the wrong tool
(0.10 + 0.05 + 0.05 + at most 0.05).

The partial credit is at most `MAX_PARTIAL` = 0.5, so with `check_weight` > 2/3 (default 0.7) a
passing answer always outranks a failing one whatever RULER says (0.7 * 1 > 0.7 * 0.5 + 0.3);
RULER orders the trajectories within each class. `--judge none` scores by the credit alone (every
scenario must then have an expected answer).

Failures are never a silent zero: when RULER fails on a checkable group, the group is scored by
the credit alone, counted (`metrics["check_only"] = 1`) and logged in `group.logs`; a group with no
check is left unscored (rewards None, `metrics["ruler_errors"] = 1`) and is dropped before
training, counted by the loop. Trajectories whose server crashed or hung are taken out of their
group before scoring (`split_failed`); they are counted, not trained on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from art_core.types import Trajectory, TrajectoryGroup
from autorl.judge import JudgeConfig
from autorl.judging import RulerConfig
from autorl.ruler import ruler_score_group
from mcp_rl.scenarios import Scenario, check_answer, numbers_in

logger = logging.getLogger(__name__)

RUBRIC = """\
- The agent must complete the user's task with the tools and end by calling complete_task with a final answer.
- An answer supported by the tool results scores far above one that is guessed, wrong, or missing.
- Give partial credit for real progress: the right tool called with the right arguments.
- Among equally good trajectories, fewer turns, fewer failed tool calls and a clearer answer score higher."""
"""The grading standards RULER is given for MCP agents."""

PARTS: Mapping[str, float] = {"completed": 0.10, "tool_ok": 0.05, "found": 0.25, "typed": 0.05, "close": 0.05}
"""Partial credit for a failing answer, by part (module docstring)."""

MAX_PARTIAL = sum(PARTS.values())
"""The most a failing answer can earn (0.5)."""


def answer_of(trajectory: Trajectory) -> str | None:
    """The final answer given to complete_task, or None when the rollout never called it."""
    answer = trajectory.metadata.get("answer")
    return answer if isinstance(answer, str) else None


def tool_results(trajectory: Trajectory) -> list[str]:
    """The texts of the server's successful tool results (errors and complete_task's reply left out)."""
    return [
        str(m.get("content") or "")
        for m in trajectory.messages
        if m.get("role") == "tool"
        and not str(m.get("content") or "").startswith("Error")
        and m.get("content") != "Task complete."
    ]


def closeness(answer: str, expected: float) -> float:
    """1 - relative distance of the answer's number nearest to `expected` (0 without a number); pure."""
    found = numbers_in(answer)
    if not found:
        return 0.0
    distance = min(abs(v - expected) for v in found)
    return max(0.0, 1.0 - distance / max(abs(expected), 1.0))


def credit_parts(scenario: Scenario, answer: str | None, results: list[str]) -> dict[str, float]:
    """Each part's credit for a failing answer (module docstring); pure. Needs `scenario.expected`."""
    assert scenario.expected is not None
    probe = Scenario(id="probe", task="-", expected=scenario.expected, check=scenario.check)
    parts = {
        "completed": float(bool(answer and answer.strip())),
        "tool_ok": float(bool(results)),
        "found": float(any(check_answer(probe, r) for r in results)),
        "typed": 0.0,
        "close": 0.0,
    }
    if answer and answer.strip() and results:
        if scenario.check == "number":
            expected = numbers_in(scenario.expected)[0]
            parts["typed"] = float(bool(numbers_in(answer)))
            parts["close"] = closeness(answer, expected)
        else:
            parts["typed"] = 1.0
    return {name: PARTS[name] * value for name, value in parts.items()}


def check_credit(scenario: Scenario, trajectory: Trajectory) -> float | None:
    """1.0 for a passing answer, else the partial credit (<= MAX_PARTIAL); None without a check."""
    answer = answer_of(trajectory)
    passed = check_answer(scenario, answer)
    if passed is None:
        return None
    if passed:
        return 1.0
    return math.fsum(credit_parts(scenario, answer, tool_results(trajectory)).values())


def split_failed(group: TrajectoryGroup) -> tuple[TrajectoryGroup, list[Trajectory]]:
    """The group without trajectories whose server failed, and those trajectories; the group's
    `metrics["server_failures"]` counts them (summed into the step's `train/server_failures`)."""
    failed = [t for t in group.trajectories if t.metrics.get("server_failure")]
    kept = [t for t in group.trajectories if not t.metrics.get("server_failure")]
    metrics = {**group.metrics, "server_failures": group.metrics.get("server_failures", 0) + len(failed)}
    return group.model_copy(update={"trajectories": kept, "metrics": metrics}), failed


def mark_success(group: TrajectoryGroup, scenario: Scenario) -> None:
    """Set `metrics["success"]` and `metrics["check_credit"]` (checkable scenarios only)."""
    for trajectory in group.trajectories:
        credit = check_credit(scenario, trajectory)
        if credit is not None:
            trajectory.metrics["success"] = credit == 1.0
            trajectory.metrics["check_credit"] = credit


async def score_group(
    group: TrajectoryGroup,
    scenario: Scenario,
    judge: JudgeConfig | str | None,
    *,
    check_weight: float = 0.7,
    ruler_config: RulerConfig | None = None,
) -> TrajectoryGroup:
    """A scored copy of `group` (module docstring); `judge=None` uses the check alone."""
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
            trajectory.reward = float(trajectory.metrics["check_credit"])
        return scored
    scored = await ruler_score_group(group, judge, RUBRIC, on_error="count", config=ruler_config)
    if not scenario.checkable:
        return scored
    failed = bool(scored.metrics.get("ruler_errors"))
    for trajectory in scored.trajectories:
        credit = float(trajectory.metrics["check_credit"])
        ruler: Any = trajectory.metrics.get("ruler_score")
        trajectory.reward = (
            credit if failed or ruler is None else check_weight * credit + (1 - check_weight) * float(ruler)
        )
    if failed:
        scored.metrics.update(ruler_errors=0, check_only=1)
        scored.logs.append(
            f"scenario {scenario.id}: RULER failed, so this group is scored by its check alone"
        )
    return scored


def trainable(group: TrajectoryGroup) -> bool:
    """Whether every trajectory of the group has a reward and there are at least two."""
    return len(group.trajectories) >= 2 and all(t.reward is not None for t in group.trajectories)


__all__ = [
    "MAX_PARTIAL",
    "PARTS",
    "RUBRIC",
    "answer_of",
    "check_credit",
    "closeness",
    "credit_parts",
    "mark_success",
    "score_group",
    "split_failed",
    "tool_results",
    "trainable",
]
