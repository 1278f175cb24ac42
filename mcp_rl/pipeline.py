"""`mcp-rl train` end to end: catalog -> scenarios -> baseline eval -> GRPO steps -> eval -> report.

Everything lands under `out/`: `server.log` (server stderr), `scenarios.jsonl` (unless
`--scenarios` names the file), the model (`out/mcp-rl/models/<name>/`: checkpoints and the
backend's history), `history.jsonl` and `loop.json` (autorl's training loop: one record per
step, and the data position), `reward.png`, `report.md` and `summary.json`. The steps are
autorl's `train_loop` with an MCP rollout (`run_agent`) and an MCP scorer (`score_group`: the
shaped check plus RULER); running the same command again resumes at the model's step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_core import TrainConfig, TrajectoryGroup
from art_core.backends import LocalBackend
from art_core.model import TrainableModel
from art_core.types import Trajectory
from autorl.head_to_head import HeadToHead
from autorl.judge import JudgeConfig
from autorl.loop import LoopConfig, train_loop
from mcp_rl.agent import AgentConfig, run_agent
from mcp_rl.catalog import ServerCatalog, read_catalog
from mcp_rl.connection import ServerConnection
from mcp_rl.evaluation import EvalResult, check_solvable, evaluate, head_to_head
from mcp_rl.generation import generate_scenarios
from mcp_rl.rewards import score_group, split_failed
from mcp_rl.scenarios import Scenario, load_scenarios, save_scenarios, split_of
from mcp_rl.server_spec import Isolation, ServerSpec
from mcp_rl.servers import ServerPool
from mcp_rl.toolbox import ToolCallConfig

logger = logging.getLogger(__name__)

PROJECT = "mcp-rl"


@dataclass(frozen=True)
class RunConfig:
    """Settings of one `mcp-rl train` run."""

    server: ServerSpec
    """The MCP server."""
    out: Path = Path("mcp-rl-out")
    """Folder of everything the run writes; running again resumes from it."""
    model: str = "smollm2-135m"
    """Base model to train (alias, local folder, .gguf file or cached hub id)."""
    name: str = "agent"
    """The trained model's name (a folder under `out/mcp-rl/models/`)."""
    judge: str = "local"
    """RULER's judge: "local" (the starting model on our own server), "none" (checks only), or a
    LiteLLM model string such as "openai/gpt-4.1-mini"."""
    generator: str = "local"
    """Scenario generator, same forms as `judge` ("none" not allowed)."""
    scenarios: Path | None = None
    """A scenario file to use; generated (and saved there) when it does not exist yet."""
    n_scenarios: int = 16
    """Scenarios to generate when there is no file."""
    val_fraction: float = 0.25
    """Share of generated scenarios held out for validation."""
    solvability_attempts: int = 2
    """Attempts per generated scenario in the solvability filter (0: skip it)."""
    steps: int = 5
    """Training steps in all (a resumed run continues up to this step). The defaults (5 steps of
    2 x 4 rollouts, 2 validation rollouts per scenario) are sized for SmolLM2-135M on a 2-core CPU:
    4:45 on a quiet one, 23-33 minutes on one shared with 4-5 other jobs (docs/benchmarks.md)."""
    groups_per_step: int = 2
    """Scenarios per step."""
    group_size: int = 4
    """Rollouts per scenario; GRPO compares them with each other."""
    learning_rate: float = 1e-3
    """LoRA learning rate (high, because the default run has only a few steps)."""
    lora_rank: int = 16
    """LoRA rank."""
    check_weight: float = 0.7
    """Weight of a scenario's check against RULER in the reward (see mcp_rl.rewards)."""
    val_rollouts: int = 2
    """Rollouts per validation scenario, before and after training."""
    isolation: Isolation = "per-rollout"
    """`per-rollout` (own server process per rollout) or `shared` (one server for all)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent loop (turns, tokens per turn, tool_choice)."""
    tools: ToolCallConfig = field(default_factory=ToolCallConfig)
    """Tool-call limits (timeout, output cap)."""
    seed: int = 0
    """Seed of the scenario order and of the train/val split."""

    def __post_init__(self) -> None:
        for name in ("steps", "groups_per_step", "val_rollouts", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("--group-size must be >= 2: GRPO compares rollouts of one scenario")
        if self.n_scenarios < 2 or self.solvability_attempts < 0:
            raise ValueError("--n-scenarios must be >= 2 and solvability attempts >= 0")
        if self.generator == "none":
            raise ValueError("--generator none cannot write scenarios; pass --scenarios FILE instead")


StepCallback = Callable[[str, dict[str, Any]], None]
"""Progress: called with an event name ("catalog", "scenarios", "eval", "step", "done") and details."""


def endpoint(choice: str, model: TrainableModel) -> JudgeConfig | None:
    """A judge/generator choice as an endpoint: "local" is the starting model on our own server."""
    if choice == "none":
        return None
    if choice == "local":
        return JudgeConfig(
            model=model.get_inference_name(0),
            base_url=model.inference_base_url,
            api_key=model.inference_api_key,
            max_tokens=512,
            explanation_max_chars=160,
        )
    return JudgeConfig(model=choice)


async def read_server(spec: ServerSpec, log_path: Path) -> ServerCatalog:
    """The server's catalog, from one connection (raises ServerStartError)."""
    connection = await ServerConnection(spec, log_path=log_path, name="catalog").start()
    try:
        return await read_catalog(connection.client)
    finally:
        await connection.close()


async def prepare_scenarios(
    config: RunConfig, catalog: ServerCatalog, model: TrainableModel, pool: ServerPool
) -> list[Scenario]:
    """The run's scenarios: the given file, or generated, filtered for solvability and saved."""
    path = config.scenarios or config.out / "scenarios.jsonl"
    if path.exists():
        return load_scenarios(path)
    generator = endpoint(config.generator, model)
    assert generator is not None
    scenarios = await generate_scenarios(
        catalog, config.n_scenarios, generator, val_fraction=config.val_fraction, seed=config.seed
    )
    if config.solvability_attempts:
        scenarios = await check_solvable(
            model, scenarios, catalog, pool, model_name=model.get_inference_name(0),
            attempts=config.solvability_attempts, agent=config.agent, tool_config=config.tools,
        )  # fmt: skip
    save_scenarios(path, scenarios)
    logger.info("wrote %d scenarios to %s (edit it and pass --scenarios to reuse)", len(scenarios), path)
    return scenarios


async def prepare_scenarios_only(config: RunConfig, *, drop_unsolvable: bool = False) -> list[Scenario]:
    """`mcp-rl scenarios`: generate, filter and save the scenario file, with no training."""
    config.out.mkdir(parents=True, exist_ok=True)
    catalog = await read_server(config.server, config.out / "server.log")
    model = TrainableModel(project=PROJECT, name="scenario-solver", base_model=config.model)
    backend = LocalBackend(config.out / ".mcp-rl-scenarios")
    pool = ServerPool(config.server, config.isolation, log_path=config.out / "server.log")
    try:
        await model.register(backend)
        scenarios = await prepare_scenarios(config, catalog, model, pool)
    finally:
        await pool.close()
        await backend.close()
    if drop_unsolvable:
        scenarios = [s for s in scenarios if s.solvable is not False]
        save_scenarios(config.scenarios or config.out / "scenarios.jsonl", scenarios)
    return scenarios


@dataclass
class StepCounts:
    """What the MCP scorer saw during this run's training steps (autorl's history holds the rest)."""

    server_failures: int = 0
    """Rollouts whose server crashed or hung (taken out of their group, not trained on)."""
    tool_errors: int = 0
    """Tool calls that came back as errors, over the scored rollouts."""
    check_only: int = 0
    """Checkable groups scored by the check alone because RULER failed on them."""
    too_small: int = 0
    """Groups left with fewer than 2 rollouts after server failures (not scored, not trained)."""


def mcp_scorer(
    config: RunConfig, scenarios: list[Scenario], judge: JudgeConfig | None, counts: StepCounts
) -> Callable[[TrajectoryGroup], Any]:
    """The loop's `score(group)`: failed rollouts out, then the shaped check plus RULER (mcp_rl.rewards)."""
    by_id = {s.id: s for s in scenarios}

    async def score(group: TrajectoryGroup) -> TrajectoryGroup:
        kept, failed = split_failed(group)
        counts.server_failures += len(failed)
        counts.tool_errors += sum(int(t.metrics.get("tool_errors", 0)) for t in group.trajectories)
        if len(kept.trajectories) < 2:
            counts.too_small += int(bool(group.trajectories))
            return kept  # rewards stay unset: the loop leaves the group out
        scenario = by_id[str(kept.trajectories[0].metadata["scenario_id"])]
        scored = await score_group(kept, scenario, judge, check_weight=config.check_weight)
        counts.check_only += int(scored.metrics.get("check_only", 0))
        return scored

    return score


async def run_steps(
    config: RunConfig, model: TrainableModel, catalog: ServerCatalog, pool: ServerPool,
    train: list[Scenario], judge: JudgeConfig | None, on_event: StepCallback | None,
) -> tuple[list[dict[str, Any]], StepCounts]:  # fmt: skip
    """autorl's training loop over the train scenarios (resumes at the model's step); its history and
    this run's MCP counts."""
    counts = StepCounts()

    async def rollout(scenario: Scenario) -> Trajectory:
        return await run_agent(model, scenario, catalog, pool, agent=config.agent, tool_config=config.tools)

    def on_step(record: dict[str, Any]) -> None:
        if on_event:
            on_event("step", {**record, "server_failures": counts.server_failures})

    loop = LoopConfig(
        steps=config.steps, groups_per_step=config.groups_per_step, group_size=config.group_size,
        seed=config.seed, train=TrainConfig(learning_rate=config.learning_rate),
    )  # fmt: skip
    history = await train_loop(
        model, train, rollout=rollout, score=mcp_scorer(config, train, judge, counts), config=loop,
        state_dir=config.out, item_id=lambda s: s.id, on_step=on_step,
    )  # fmt: skip
    return history, counts


async def _evaluate(
    config: RunConfig,
    model: TrainableModel,
    val: list[Scenario],
    catalog: ServerCatalog,
    pool: ServerPool,
    name: str,
) -> EvalResult:
    return await evaluate(
        model,
        val,
        catalog,
        pool,
        model_name=name,
        rollouts=config.val_rollouts,
        agent=config.agent,
        tool_config=config.tools,
    )


def _pairs(after: EvalResult, before: EvalResult) -> list[tuple[Trajectory, Trajectory]]:
    return [
        (a[0], before.trajectories[sid][0])
        for sid, a in after.trajectories.items()
        if a and before.trajectories.get(sid)
    ]


async def run(config: RunConfig, on_event: StepCallback | None = None) -> dict[str, Any]:
    """Train on the server and return the summary (also written to `out/summary.json`)."""
    from mcp_rl.report import write_report

    started = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    catalog = await read_server(config.server, config.out / "server.log")
    if on_event:
        on_event(
            "catalog",
            {
                "tools": catalog.tool_names,
                "resources": len(catalog.resources),
                "prompts": len(catalog.prompts),
            },
        )
    model = TrainableModel(
        project=PROJECT, name=config.name, base_model=config.model, lora_rank=config.lora_rank
    )
    backend = LocalBackend(config.out)
    pool = ServerPool(config.server, config.isolation, log_path=config.out / "server.log")
    try:
        await model.register(backend)
        scenarios = await prepare_scenarios(config, catalog, model, pool)
        train, val = split_of(scenarios, "train"), split_of(scenarios, "val")
        if not train:
            raise ValueError('the scenarios have no \'train\' split; mark some lines "split": "train"')
        if on_event:
            on_event("scenarios", {"train": len(train), "val": len(val)})
        judge = endpoint(config.judge, model)
        before = (
            await _evaluate(config, model, val, catalog, pool, model.get_inference_name(0)) if val else None
        )  # type: ignore[arg-type]
        if on_event and before:
            on_event("eval", {"when": "before", **before.summary()})
        history, counts = await run_steps(config, model, catalog, pool, train, judge, on_event)
        after = (
            await _evaluate(config, model, val, catalog, pool, model.get_inference_name()) if val else None
        )  # type: ignore[arg-type]
        if on_event and after:
            on_event("eval", {"when": "after", **after.summary()})
        duel = await head_to_head(_pairs(after, before), judge) if judge and before and after else None
    finally:
        await pool.close()
        await backend.close()
    summary = summarise(config, train, val, history, before, after, duel, counts, pool.stats.restarts)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    details = {"before": before.summary() if before else None, "after": after.summary() if after else None,
               "head_to_head": duel.__dict__ if duel else None, "pool": pool.stats.__dict__,
               "training": counts.__dict__}  # fmt: skip
    write_report(
        config.out, summary, details, history, examples=_examples(after, before), judged=judge is not None
    )
    if on_event:
        on_event("done", summary)
    return summary


def summarise(
    config: RunConfig, train: list[Scenario], val: list[Scenario], history: list[dict[str, Any]],
    before: EvalResult | None, after: EvalResult | None, duel: HeadToHead | None, counts: StepCounts,
    restarts: int,
) -> dict[str, Any]:  # fmt: skip
    """The `--json` summary (the issue's 12 keys, null where a figure does not apply); pure."""
    rewards = [h["reward"] for h in history if h.get("reward") is not None]
    window = max(1, min(3, len(rewards)))
    eval_errors = sum(int(c["errors"]) for e in (before, after) if e for c in e.tools.values())
    return {
        "server": config.server.describe(),
        "scenarios_train": len(train),
        "scenarios_val": len(val),
        "steps": len(history),
        "seconds": None,
        "first_reward": sum(rewards[:window]) / window if rewards else None,
        "last_reward": sum(rewards[-window:]) / window if rewards else None,
        "val_success_before": before.success_rate if before else None,
        "val_success_after": after.success_rate if after else None,
        "win_rate": duel.win_rate if duel else None,
        "tool_errors": counts.tool_errors + eval_errors,
        "server_restarts": restarts,
    }


def _examples(after: EvalResult | None, before: EvalResult | None) -> list[dict[str, str]]:
    """Validation answers side by side for the report: task, trained answer, starting answer."""
    if after is None or before is None:
        return []
    return [
        {"input": str(t.messages[1].get("content")), "trained": str(t.metadata.get("answer")),
         "baseline": str(before.trajectories[sid][0].metadata.get("answer"))}
        for sid, (t, *_) in after.trajectories.items() if before.trajectories.get(sid)
    ][:6]  # fmt: skip


__all__ = [
    "PROJECT",
    "RunConfig",
    "endpoint",
    "prepare_scenarios",
    "prepare_scenarios_only",
    "read_server",
    "run",
    "mcp_scorer",
    "run_steps",
    "summarise",
]
