"""The mcp-rl agent loop against our real server (tiny model) and real MCP servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from art_core.model import TrainableModel
from integrations.mcp import tool_calls_from_logs
from mcp_rl.agent import AgentConfig, run_agent
from mcp_rl.catalog import ServerCatalog, read_catalog
from mcp_rl.connection import ServerConnection
from mcp_rl.evaluation import EvaluationError, evaluate
from mcp_rl.rewards import MAX_PARTIAL, PARTS, check_credit, score_group, split_failed
from mcp_rl.scenarios import Scenario
from mcp_rl.servers import ServerPool
from mcp_rl.toolbox import ToolCallConfig
from tests.helpers_mcp import EXAMPLE_SCENARIOS, EXAMPLE_SERVER, ROOT, example_spec, fault_spec
from tests.helpers_serving import served_fixture

ASYNC = pytest.mark.asyncio(loop_scope="module")
served = served_fixture("mcp_rl", project="mcp-rl-tests", name="agent")
AGENT = AgentConfig(max_turns=3, max_tokens=48, max_string_chars=8)
FIGS = Scenario(id="figs", task="How many figs are in stock?", expected="4", check="number")


async def _say(model: TrainableModel, text: str) -> None:
    await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=2
    )


async def _fault_catalog() -> ServerCatalog:
    connection = await ServerConnection(fault_spec()).start()
    try:
        return await read_catalog(connection.client)
    finally:
        await connection.close()


@ASYNC
async def test_agent_rollout_exact_tokens_tool_messages_and_metrics(
    model: TrainableModel, tmp_path: Path
) -> None:
    pool = ServerPool(example_spec(), "per-rollout", log_path=tmp_path / "log")
    connection = await ServerConnection(example_spec()).start()
    catalog = await read_catalog(connection.client)
    await connection.close()
    trajectories = await asyncio.gather(
        *(run_agent(model, FIGS, catalog, pool, agent=AGENT) for _ in range(3))
    )
    for t in trajectories:
        assert 1 <= len(t.turns) == t.metrics["turns"] <= AGENT.max_turns
        assert t.tools is not None and t.tools[-1]["function"]["name"] == "complete_task"
        assert t.messages[:2] == [t.messages[0], {"role": "user", "content": FIGS.task}]
        calls = [c for m in t.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        tool_messages = [m for m in t.messages if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in tool_messages] == [c["id"] for c in calls]  # one result per call
        mcp_calls = [c for c in calls if c["function"]["name"] != "complete_task"]
        assert t.metrics.get("tool_calls", 0) == len(mcp_calls) == len(tool_calls_from_logs(t.logs))
        assert t.metrics["task_completed"] == (t.metadata["answer"] is not None)
        if t.metrics["task_completed"]:
            assert t.messages[-1] == {
                "role": "tool",
                "tool_call_id": calls[-1]["id"],
                "content": "Task complete.",
            }
    assert pool.stats.starts == 3 and pool.stats.failures == 0


@ASYNC
async def test_a_server_crash_fails_only_that_rollout(model: TrainableModel, tmp_path: Path) -> None:
    """tool_choice names `crash`, so the first call kills the server: the rollout ends with the reason
    in its logs, the group is scored without it, and the next rollout gets a fresh server."""
    pool = ServerPool(fault_spec(), "shared", log_path=tmp_path / "log")
    try:
        async with pool.lease() as first:
            catalog = await read_catalog(first.client)
        crash = AgentConfig(max_turns=2, max_tokens=48, tool_choice="crash")
        failed = await run_agent(model, FIGS, catalog, pool, agent=crash)
        fine = await asyncio.gather(
            *(
                run_agent(
                    model,
                    FIGS,
                    catalog,
                    pool,
                    agent=AgentConfig(max_turns=2, max_tokens=48, tool_choice="echo", max_string_chars=8),
                )
                for _ in range(2)
            )
        )
    finally:
        await pool.close()
    assert failed.metrics["server_failure"] is True and failed.metrics["turns"] == 1
    assert "closed the connection during crash" in str(failed.metadata["failure"])
    assert any(line.startswith("rollout failed:") for line in failed.logs)
    assert pool.stats.failures == 1 and pool.stats.restarts == 1 and pool.stats.starts == 2
    assert all(not t.metrics["server_failure"] and t.metrics["tool_calls/echo"] == 2 for t in fine)
    from art_core.types import TrajectoryGroup

    kept, dropped = split_failed(TrajectoryGroup([failed, *fine]))
    assert dropped == [failed] and len(kept.trajectories) == 2
    scored = await score_group(kept, FIGS, None)
    assert all(t.metadata["answer"] is None for t in kept.trajectories)  # echo, never complete_task
    assert [t.reward for t in scored.trajectories] == [check_credit(FIGS, t) for t in kept.trajectories]
    assert all(t.reward is not None and t.reward <= MAX_PARTIAL for t in scored.trajectories)


@ASYNC
async def test_a_hanging_tool_past_the_timeout_fails_the_rollout(
    model: TrainableModel, tmp_path: Path
) -> None:
    pool = ServerPool(fault_spec(), "per-rollout", log_path=tmp_path / "log")
    catalog = await _fault_catalog()
    hang = AgentConfig(max_turns=2, max_tokens=48, tool_choice="hang")
    trajectory = await run_agent(
        model, FIGS, catalog, pool, agent=hang, tool_config=ToolCallConfig(timeout_s=1.0, ping_timeout_s=1.0)
    )
    assert trajectory.metrics["server_failure"] is True
    assert "hang timed out" in str(trajectory.metadata["failure"]) and pool.stats.hangs == 1


@ASYNC
async def test_a_conversation_that_outgrows_the_context_window_ends_unfinished_not_raised(
    model: TrainableModel, tmp_path: Path
) -> None:
    pool = ServerPool(fault_spec(), "per-rollout", log_path=tmp_path / "log")
    catalog = await _fault_catalog()
    flood = AgentConfig(max_turns=3, max_tokens=48, tool_choice="flood")
    trajectory = await run_agent(model, FIGS, catalog, pool, agent=flood)
    metrics = trajectory.metrics
    assert metrics["context_exhausted"] is True and metrics["ran_out_of_turns"] is False
    assert metrics["turns"] == 1 and metrics["tool_calls/flood"] == 1 and not metrics["server_failure"]
    assert len(trajectory.turns) == 1 and trajectory.messages[-1]["role"] == "tool"
    assert any("turn 2 did not fit the context window" in line for line in trajectory.logs)
    assert check_credit(FIGS, trajectory) < MAX_PARTIAL  # scored as unfinished
    # A first turn that does not fit sampled nothing: that is an error, not a trajectory.
    too_long = Scenario(id="long", task="x" * 5000)
    with pytest.raises(openai.BadRequestError, match="context window"):
        await run_agent(model, too_long, catalog, pool, agent=flood)


@ASYNC
async def test_an_evaluation_whose_every_rollout_fails_is_an_error_not_a_zero(
    model: TrainableModel, tmp_path: Path
) -> None:
    catalog = await _fault_catalog()
    dead = ServerPool(fault_spec("--die-at-start"), "per-rollout", log_path=tmp_path / "log")
    with pytest.raises(
        EvaluationError, match=r"(?s)all 4 evaluation rollouts of .* failed; .*dying at start"
    ):
        await evaluate(model, [FIGS, FIGS], catalog, dead, model_name=model.name, rollouts=2, agent=AGENT)
    assert dead.stats.start_failures == 4
    live = ServerPool(fault_spec(), "per-rollout", log_path=tmp_path / "log")
    result = await evaluate(model, [FIGS], catalog, live, model_name=model.name, rollouts=2, agent=AGENT)
    assert result.rollouts == 2 and result.exceptions == 0 and len(result.trajectories["figs"]) == 2
    assert result.summary()["rollouts"] == 2


async def test_rewards_combine_the_check_with_ruler_so_a_pass_always_wins() -> None:
    from art_core.types import Trajectory, TrajectoryGroup

    def traj(answer: str, ruler: float) -> Trajectory:
        return Trajectory(
            messages=[{"role": "user", "content": "q"}],
            metadata={"answer": answer},
            metrics={"ruler_score": ruler},
        )

    group = TrajectoryGroup([traj("there are 4", 0.0), traj("none", 1.0)])
    scored = await score_group(group, FIGS, None)
    assert [t.reward for t in scored.trajectories] == [1.0, pytest.approx(PARTS["completed"])]
    with pytest.raises(ValueError, match="no expected answer"):
        await score_group(group, Scenario(id="open", task="Describe the stock."), None)


def test_mcp_rl_train_cli_on_the_example_with_the_tiny_model(tmp_path: Path) -> None:
    """`mcp-rl train` end to end (tiny model, 1 step, judge none): the last line is the JSON summary."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "mcp_rl.cli", "train", "--server", f"{sys.executable} {EXAMPLE_SERVER}",
        "--model", "tiny-random", "--judge", "none", "--steps", "1", "--group-size", "2", "--groups-per-step", "1",
        "--val-rollouts", "1", "--max-turns", "2", "--scenarios", str(EXAMPLE_SCENARIOS), "--out", str(out), "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(summary) == [
        "server", "scenarios_train", "scenarios_val", "steps", "seconds", "first_reward", "last_reward",
        "val_success_before", "val_success_after", "win_rate", "tool_errors", "server_restarts",
    ]  # fmt: skip
    assert (summary["scenarios_train"], summary["scenarios_val"], summary["steps"]) == (12, 6, 1)
    assert summary["win_rate"] is None and summary["server_restarts"] == 0  # no judge: no head-to-head
    assert 0.0 <= summary["val_success_before"] <= 1.0
    assert (out / "report.md").exists() and (out / "server.log").exists()
    report = (out / "report.md").read_text()
    assert "success rate" in report and "RULER" not in report  # no judge: no RULER score is claimed
    assert "no judge (`--judge none`)" in report and "mean reward (check)" in report


def test_mcp_rl_cli_dies_at_start_is_a_clear_error(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "mcp_rl.cli", "train", "--server", f"{sys.executable} {ROOT / 'tests' / 'mcp_rl' / 'fault_server.py'} --die-at-start",
               "--model", "tiny-random", "--out", str(tmp_path / "o"), "--scenarios", str(EXAMPLE_SCENARIOS)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert "could not connect to MCP server" in done.stderr and "dying at start as asked" in done.stderr


@pytest.mark.slow
def test_mcp_rl_train_cli_smoke_on_smollm2(tmp_path: Path) -> None:
    """`mcp-rl train` with SmolLM2 and its defaults at tiny sizes (one train and one validation
    scenario, 1 step, a group of 2, the local judge in RULER's weighted mode): it scores with the
    judge, trains, and judges the head-to-head."""
    out = tmp_path / "run"
    lines = EXAMPLE_SCENARIOS.read_text().splitlines()
    scenarios = tmp_path / "two.jsonl"
    scenarios.write_text(
        "\n".join([lines[0], next(line for line in lines if '"split": "val"' in line)]) + "\n"
    )
    command = [
        sys.executable, "-m", "mcp_rl.cli", "train", "--server", f"{sys.executable} {EXAMPLE_SERVER}",
        "--steps", "1", "--group-size", "2", "--groups-per-step", "1", "--val-rollouts", "1", "--max-turns", "2",
        "--scenarios", str(scenarios), "--out", str(out), "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["scenarios_train"], summary["scenarios_val"], summary["steps"]) == (1, 1, 1)
    assert summary["first_reward"] is not None and summary["win_rate"] is not None
    (record,) = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert record["groups_scored"] == 1 and record["judge_errors"] == 0 and record["judge_calls"] >= 1
    report = (out / "report.md").read_text()
    assert (out / "reward.png").exists() and "validation success rate" in report
    assert "shaped check and RULER combined" in report and "mean reward (check and RULER)" in report
