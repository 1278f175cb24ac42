"""Before/after on the validation scenarios: success rate, head-to-head, per-tool calls and errors, turns.

`evaluate` runs each scenario `rollouts` times with one served model name (`name@0`: the starting
model; `name`: the trained one) and summarises. `head_to_head` hands the trained model's and the
starting model's trajectory of each scenario to `autorl.head_to_head` (RULER in both orders, ties
and split verdicts count half, a Wilson interval, judge failures counted and never scored): the
prompt is the system prompt and the task, each answer the messages that followed (tool calls and
results included). The judge sees the tool calls but not the tool schemas there: autorl's
head-to-head takes no `tools` yet.

`check_solvable` is the solvability filter: a scenario is solvable when one of `attempts`
rollouts with the real tools completes it (passes its check; without a check, ends with
complete_task after at least one successful tool call).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from art_core import gather_trajectories
from art_core.model import TrainableModel
from art_core.types import Trajectory
from autorl.head_to_head import HeadToHead
from autorl.head_to_head import head_to_head as shared_head_to_head
from autorl.judge import JudgeConfig
from mcp_rl.agent import AgentConfig, run_agent
from mcp_rl.catalog import ServerCatalog
from mcp_rl.rewards import RUBRIC
from mcp_rl.scenarios import Scenario, check_answer
from mcp_rl.servers import ServerPool
from mcp_rl.toolbox import ToolCallConfig

logger = logging.getLogger(__name__)


class EvaluationError(RuntimeError):
    """Every rollout of an evaluation failed, so it measured nothing."""


@dataclass
class EvalResult:
    """What one model did on a set of scenarios."""

    trajectories: dict[str, list[Trajectory]] = field(default_factory=dict)
    """Per scenario id, its trajectories (failed rollouts excluded; see `exceptions`)."""
    success_rate: float | None = None
    """Share of rollouts of checkable scenarios whose answer passed; None without any."""
    completed_rate: float = 0.0
    """Share of rollouts that ended with complete_task."""
    mean_turns: float = 0.0
    tools: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per tool: calls, errors, error_rate."""
    rollouts: int = 0
    """Rollouts attempted (scenarios x rollouts each)."""
    server_failures: int = 0
    exceptions: int = 0
    """Rollouts that raised (e.g. a server that would not start); the rates leave them out."""

    def summary(self) -> dict[str, Any]:
        return {
            "success_rate": self.success_rate,
            "completed_rate": self.completed_rate,
            "mean_turns": self.mean_turns,
            "tools": self.tools,
            "rollouts": self.rollouts,
            "server_failures": self.server_failures,
            "exceptions": self.exceptions,
        }


def tool_stats(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Calls, errors and error rate per tool, from the MCP door's metrics."""
    counts: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "errors": 0})
    for trajectory in trajectories:
        for key, value in trajectory.metrics.items():
            kind, _, tool = key.partition("/")
            if tool and kind in ("tool_calls", "tool_errors"):
                counts[tool]["calls" if kind == "tool_calls" else "errors"] += float(value)
    return {
        tool: {**c, "error_rate": c["errors"] / c["calls"] if c["calls"] else 0.0}
        for tool, c in sorted(counts.items())
    }


def _succeeded(scenario: Scenario, trajectory: Trajectory) -> bool:
    if trajectory.metrics.get("server_failure") or not trajectory.metrics.get("task_completed"):
        return False
    answer = trajectory.metadata.get("answer")
    passed = check_answer(scenario, answer if isinstance(answer, str) else None)
    if passed is not None:
        return passed
    return int(trajectory.metrics.get("tool_calls", 0)) > int(trajectory.metrics.get("tool_errors", 0))


async def evaluate(
    model: TrainableModel,
    scenarios: Sequence[Scenario],
    catalog: ServerCatalog,
    pool: ServerPool,
    *,
    model_name: str,
    rollouts: int = 1,
    agent: AgentConfig | None = None,
    tool_config: ToolCallConfig | None = None,
) -> EvalResult:
    """Run every scenario `rollouts` times with `model_name` and summarise (see EvalResult).

    Rollouts that raise are logged and counted in `exceptions`; when every one raised, the
    evaluation measured nothing and `EvaluationError` says why (the first failure)."""
    jobs = [
        (s, run_agent(model, s, catalog, pool, agent=agent, tool_config=tool_config, model_name=model_name))
        for s in scenarios
        for _ in range(rollouts)
    ]
    results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
    result = EvalResult(rollouts=len(jobs))
    failures = [o for o in results if isinstance(o, BaseException)]
    if jobs and len(failures) == len(jobs):
        raise EvaluationError(
            f"all {len(jobs)} evaluation rollouts of {model_name} failed; the first: {failures[0]}"
        ) from failures[0]
    done: list[Trajectory] = []
    checked: list[bool] = []
    for (scenario, _), outcome in zip(jobs, results, strict=True):
        if isinstance(outcome, BaseException):
            logger.warning("evaluation rollout of %s failed: %s", scenario.id, outcome)
            result.exceptions += 1
            continue
        if outcome.metrics.get("server_failure"):
            result.server_failures += 1
        result.trajectories.setdefault(scenario.id, []).append(outcome)
        done.append(outcome)
        if scenario.checkable:
            checked.append(_succeeded(scenario, outcome))
    result.success_rate = sum(checked) / len(checked) if checked else None
    result.completed_rate = (
        sum(bool(t.metrics.get("task_completed")) for t in done) / len(done) if done else 0.0
    )
    result.mean_turns = sum(float(t.metrics.get("turns", 0)) for t in done) / len(done) if done else 0.0
    result.tools = tool_stats(done)
    return result


async def check_solvable(
    model: TrainableModel,
    scenarios: Sequence[Scenario],
    catalog: ServerCatalog,
    pool: ServerPool,
    *,
    model_name: str,
    attempts: int = 2,
    agent: AgentConfig | None = None,
    tool_config: ToolCallConfig | None = None,
) -> list[Scenario]:
    """The scenarios with `solvable` set from `attempts` real attempts each."""
    jobs = [
        run_agent(model, s, catalog, pool, agent=agent, tool_config=tool_config, model_name=model_name)
        for s in scenarios
        for _ in range(attempts)
    ]
    trajectories = await gather_trajectories(jobs, pbar=False, max_exceptions=len(jobs))
    by_id: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        by_id[str(trajectory.metadata.get("scenario_id"))].append(trajectory)
    return [replace(s, solvable=any(_succeeded(s, t) for t in by_id[s.id])) for s in scenarios]


async def head_to_head(
    pairs: Sequence[tuple[Trajectory, Trajectory]], judge: JudgeConfig | str
) -> HeadToHead:
    """Trained vs baseline on each (trained, baseline) pair of one scenario (module docstring)."""
    prompts = [trained.messages[:2] for trained, _ in pairs]
    if any(baseline.messages[:2] != prompt for (_, baseline), prompt in zip(pairs, prompts, strict=True)):
        raise ValueError("head_to_head pairs must share their system prompt and task")
    return await shared_head_to_head(
        prompts,
        [trained.messages[2:] for trained, _ in pairs],
        [baseline.messages[2:] for _, baseline in pairs],
        judge=judge,
        rubric=RUBRIC,
    )


__all__ = [
    "EvalResult",
    "EvaluationError",
    "HeadToHead",
    "check_solvable",
    "evaluate",
    "head_to_head",
    "tool_stats",
]
