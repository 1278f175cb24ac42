"""Faults injected with real parts, counted in the step's history line and logged (issue 18, item 3).

One test per fault; each checks that training goes on within `max_exceptions` (or stops with a
typed error past it), that the fault shows in the step's metrics (history.jsonl, `model.history()`)
and in the logs:

- 30% of rollouts raise (the tiny model served by a LocalBackend on 127.0.0.1);
- the judge answers garbage or times out (a SCRIPTED judge server on 127.0.0.1, not a model);
- the MCP tool server crashes mid-call (tests/mcp_rl/fault_server.py, a real subprocess);
- `art serve` is SIGKILLed while rollouts are in flight and started again (tests/backends/serve_dies.py);
- a prompt exceeds the context: a 400 `context_length_exceeded`, counted, never a hang (ART #395);
- the disk fills during a checkpoint write (a small tmpfs; tests/host/disk_full.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_core.app import wait_healthy
from art_core.backends import LocalBackend
from art_core.backends.remote import RemoteBackend
from art_core.engine.config import EngineConfig
from art_core.rollouts.groups import GatherError
from art_core.storage import ModelStorage
from autorl.judge import JudgeConfig
from autorl.judging import RulerConfig
from autorl.ruler import ruler_score_group
from mcp_rl.agent import AgentConfig, run_agent
from mcp_rl.catalog import read_catalog
from mcp_rl.rewards import score_group, split_failed
from mcp_rl.scenarios import Scenario
from mcp_rl.servers import ServerPool
from tests.backends.test_remote import KEY, STARTUP_TIMEOUT_S
from tests.backends.test_remote_restart import Serve
from tests.helpers_judge import Reply, ScriptedJudge
from tests.helpers_mcp import ROOT, fault_spec
from tests.host import disk_full

LR = TrainConfig(learning_rate=1e-2)


def _model(name: str) -> TrainableModel:
    return TrainableModel(project="faults", name=name, base_model="tiny-random")


def _text(group: int, index: int) -> str:
    return f"task {group}-{index}: name a fruit"


async def _rollout(model: TrainableModel, group: int, index: int, *, fail: bool = False) -> Trajectory:
    if fail:
        raise RuntimeError(f"rollout {group}-{index} failed on purpose")
    messages = [{"role": "user", "content": _text(group, index)}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4
    )
    return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=index / 4)


async def _train_line(model: TrainableModel, step: int) -> dict[str, Any]:
    (line,) = [h for h in await model.history() if h["step"] == step and "trained" in h]
    return line


def _failures(caplog: pytest.LogCaptureFixture, kind: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and kind in r.getMessage()]


async def test_thirty_percent_of_rollouts_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """3 of 10 rollouts raise: within max_exceptions=0.3 the step trains on the 7 others and records
    the rate; past max_exceptions=0.2 the gather stops with a GatherError and nothing trains."""
    failing = {(0, 1), (0, 3), (1, 2)}

    def groups(model: TrainableModel) -> list[TrajectoryGroup]:
        return [
            TrajectoryGroup(_rollout(model, g, i, fail=(g, i) in failing) for i in range(5)) for g in range(2)
        ]

    async with LocalBackend(tmp_path) as backend:
        model = _model("raise")
        await model.register(backend)
        with caplog.at_level(logging.WARNING):
            gathered = await gather_trajectory_groups(groups(model), pbar=False, max_exceptions=0.3)
            result = await model.train(gathered, LR)
        assert result.step == 1 and result.trained
        line = await _train_line(model, 1)
        assert line["train/exception_rate"] == pytest.approx(0.3)
        assert line["train/rollout_exceptions"] == 3 and line["train/num_trajectories"] == 7
        assert sorted(_failures(caplog, "failed: RuntimeError")) == sorted(
            f"rollout {i} of group {g} failed: RuntimeError: rollout {g}-{i} failed on purpose"
            for g, i in failing
        )
        with pytest.raises(GatherError, match=r"more than max_exceptions allows \(20% of 10 trajectories\)"):
            await gather_trajectory_groups(groups(model), pbar=False, max_exceptions=0.2)
        assert await model.get_step() == 1


def _judge_server() -> ScriptedJudge:
    """SCRIPTED judge: scores group 0 (k/n), answers garbage for group 1, too late for group 2."""
    judge = ScriptedJudge(model="scripted-faults")

    def respond(body: dict[str, Any]) -> Reply:
        prompt = json.dumps(body["messages"])
        if "task 1-" in prompt:
            return Reply("{not json at all")
        if "task 2-" in prompt:
            return Reply("{}", delay_s=3.0)
        schema = body["response_format"]["json_schema"]["schema"]["properties"]["scores"]
        ids = [p["properties"]["trajectory_id"]["const"] for p in schema["prefixItems"]]
        scores = [{"trajectory_id": i, "explanation": "ok", "score": int(i) / len(ids)} for i in ids]
        return Reply(json.dumps({"scores": scores}))

    judge.responder = respond
    return judge


async def test_judge_garbage_and_timeouts_are_counted_and_the_groups_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RULER (on_error="count") as `after_each`: the garbage and timed-out groups keep unset rewards
    (never 0.0), the step trains on the scored group, and judge/ruler errors are in the history line."""
    from art_core.server import serve_in_thread

    scripted = _judge_server()
    handle = serve_in_thread(scripted.app())
    judge = JudgeConfig(
        model=scripted.model, base_url=handle.url + "/v1", api_key="x", max_attempts=2,
        retry_backoff_s=0.0, cache=False, extra_params={"timeout": 0.5},
    )  # fmt: skip

    async def score(group: TrajectoryGroup) -> TrajectoryGroup:
        return await ruler_score_group(group, judge, on_error="count", config=RulerConfig(mode="sampled"))

    try:
        async with LocalBackend(tmp_path) as backend:
            model = _model("judge")
            await model.register(backend)
            with caplog.at_level(logging.WARNING):
                gathered = await gather_trajectory_groups(
                    [TrajectoryGroup(_rollout(model, g, i) for i in range(3)) for g in range(3)],
                    pbar=False,
                    after_each=score,
                )
                result = await model.train(gathered, LR)
            line = await _train_line(model, 1)
    finally:
        handle.stop()
    assert [g.metrics["ruler_errors"] for g in gathered] == [0, 1, 1]
    assert all(t.reward is None for g in gathered[1:] for t in g.trajectories)
    assert result.step == 1 and result.trained
    assert sum("its scoring failed" in w for w in result.warnings) == 2
    assert line["train/ruler_errors"] == 2 and line["train/groups_unscored"] == 2
    assert line["train/judge_errors"] == 4 and line["train/judge_calls"] == 5  # 1 + 2 + 2
    assert line["train/unrewarded"] == 6 and line["train/reward"] == pytest.approx(
        2 / 3
    )  # ids 1..3 scored i/3
    assert len(_failures(caplog, "RULER failed for a group of 3")) == 2
    assert len(_failures(caplog, "skipped: its scoring failed")) == 2


FIGS = Scenario(id="figs", task="How many figs are in stock?", expected="4", check="number")


async def test_a_crashing_tool_server_is_counted_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One rollout's tool call kills the MCP server process: that rollout is taken out and counted
    (`train/server_failures`), the server is restarted for the others, and the step commits."""
    pool = ServerPool(fault_spec(), "shared", log_path=tmp_path / "mcp.log")
    crash = AgentConfig(max_turns=2, max_tokens=48, tool_choice="crash")
    echo = AgentConfig(max_turns=2, max_tokens=48, tool_choice="echo", max_string_chars=8)

    async def scored(group: TrajectoryGroup) -> TrajectoryGroup:
        kept, _ = split_failed(group)
        return await score_group(kept, FIGS, None)

    try:
        async with pool.lease() as first:
            catalog = await read_catalog(first.client)
        async with LocalBackend(tmp_path / "art") as backend:
            model = _model("mcp")
            await model.register(backend)
            with caplog.at_level(logging.WARNING):
                crashed = await run_agent(model, FIGS, catalog, pool, agent=crash)
                others = [run_agent(model, FIGS, catalog, pool, agent=echo) for _ in range(3)]
                group = TrajectoryGroup([crashed], pending=others)
                gathered = await gather_trajectory_groups([group], pbar=False, after_each=scored)
                result = await model.train(gathered, LR)
            line = await _train_line(model, 1)
    finally:
        await pool.close()
    assert crashed.metrics["server_failure"] is True
    assert pool.stats.failures == 1 and pool.stats.restarts == 1
    assert len(gathered[0].trajectories) == 3 and result.step == 1
    assert line["train/server_failures"] == 1 and line["train/num_trajectories"] == 3
    assert _failures(caplog, "closed the connection during crash"), caplog.text


async def test_our_server_restarts_while_rollouts_are_in_flight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`art serve` SIGKILLs itself when the 5th chat request of a gather arrives and is started
    again: the rollouts in flight fail and are counted, the step trains on the finished group."""
    monkeypatch.setenv("ART_TEST_DIE_AFTER", "4")
    serve = Serve(tmp_path)
    serve.die = f"chat:{tmp_path / 'chat.died'}"
    serve.start()
    try:
        assert serve.process is not None
        wait_healthy(serve.url, serve.process, serve.log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
        watcher = serve.restart_when_it_dies()
        async with RemoteBackend(serve.url, api_key=KEY, retry_wait_s=STARTUP_TIMEOUT_S) as backend:
            model = _model("restart")
            await model.register(backend)
            groups = [TrajectoryGroup(_rollout(model, g, i) for i in range(4)) for g in range(2)]
            with caplog.at_level(logging.WARNING):
                gathered = await gather_trajectory_groups(
                    groups, pbar=False, max_exceptions=4, max_concurrency=4
                )
            watcher.join(timeout=60)
            assert (tmp_path / "chat.died").exists() and serve.starts == 2
            assert serve.process is not None
            wait_healthy(serve.url, serve.process, serve.log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
            await model.register(backend)  # the new process has no models yet: it resumes from disk
            result = await model.train(gathered, LR)
            assert result.step == 1 and result.trained
            line = await _train_line(model, 1)
    finally:
        serve.stop()
    assert [len(g.trajectories) for g in gathered] == [4, 0]
    assert {e.type for e in gathered[1].exceptions} <= {"APIConnectionError", "NotFoundError"}
    assert line["train/exception_rate"] == pytest.approx(0.5) and line["train/rollout_exceptions"] == 4
    assert line["train/groups_empty"] == 1
    assert len(_failures(caplog, "of group 1 failed: API")) + len(_failures(caplog, "failed: NotFound")) == 4


async def test_a_prompt_past_the_context_is_a_400_and_a_counted_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 64-token context: the over-long prompt gets a 400 `context_length_exceeded` at once (no hang),
    its rollout is counted, and the step trains on the rest."""
    long_prompt = "fruit " * 200

    async def rollout(model: TrainableModel, g: int, i: int) -> Trajectory:
        if (g, i) != (1, 3):
            return await _rollout(model, g, i)
        messages = [{"role": "user", "content": long_prompt}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4
        )
        return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=1.0)

    async with LocalBackend(tmp_path, engine_config=EngineConfig(max_context=64, batch_wait_s=0)) as backend:
        model = _model("context")
        await model.register(backend)
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.wait_for(rollout(model, 1, 3), timeout=60)
        assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
        assert "64-token context" in refused.value.message
        groups = [TrajectoryGroup(rollout(model, g, i) for i in range(4)) for g in range(2)]
        with caplog.at_level(logging.WARNING):
            gathered = await asyncio.wait_for(
                gather_trajectory_groups(groups, pbar=False, max_exceptions=1), timeout=120
            )
            result = await model.train(gathered, LR)
        assert result.step == 1 and result.trained
        line = await _train_line(model, 1)
    assert line["train/exception_rate"] == pytest.approx(1 / 8) and line["train/rollout_exceptions"] == 1
    assert line["train/rollouts_context_exceeded"] == 1
    (failure,) = gathered[1].exceptions
    assert failure.type == "BadRequestError" and "64-token context window" in failure.message
    assert failure.code == "context_length_exceeded"
    assert _failures(caplog, "rollout 3 of group 1 failed: BadRequestError")


def _mount_tmpfs(folder: Path, size: str) -> bool:
    """Mount a small tmpfs on `folder` (root with CAP_SYS_ADMIN); False where that is not allowed."""
    folder.mkdir()
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


def _can_unshare() -> bool:
    """Whether an unprivileged user and mount namespace can mount a tmpfs here."""
    if shutil.which("unshare") is None:
        return False
    probe = "mount -t tmpfs -o size=1m tmpfs /mnt"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


TMPFS_SIZE = "24m"


def _run_script(command: list[str]) -> tuple[dict[str, Any], str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


async def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint of step 2 finds the filesystem full: a StorageFullError names the folder, the
    step and the intact checkpoint 1; no temporary file or step-2 trajectories are left; the model
    still serves (rolled back to checkpoint 1), loads again, and trains step 2 once there is room.

    Mechanism, first that works: a tmpfs mounted here (root with CAP_SYS_ADMIN); a tmpfs inside
    `unshare -rm` (user namespaces, no privilege); RLIMIT_FSIZE (EFBIG) in a subprocess."""
    small = tmp_path / "small"
    if _mount_tmpfs(small, TMPFS_SIZE):
        try:
            with caplog.at_level(logging.WARNING):
                seen = await disk_full.scenario(small, "fill")
            logs = caplog.text
        finally:
            subprocess.run(["umount", "--lazy", str(small)], check=True)  # mmapped tensors may hold files
    elif _can_unshare():
        script = f"mount -t tmpfs -o size={TMPFS_SIZE} tmpfs {small} && exec {sys.executable} -m tests.host.disk_full {small} fill"
        seen, logs = _run_script(["unshare", "-rm", "sh", "-c", script])
    else:
        seen, logs = _run_script([sys.executable, "-m", "tests.host.disk_full", str(small), "rlimit"])
    root = ModelStorage.create(small, "faults", "disk").root
    if seen["mode"] == "rlimit":
        what = f"a file size limit (ulimit -f) stops writes to {root} (File too large)"
    else:
        what = f"the filesystem is full that holds {root} (No space left on device)"
    assert seen["error_type"] == "StorageFullError", seen
    assert f"{what} while writing {root / 'checkpoints' / '0002'}" in seen["error"]
    assert "step 2 was not committed" in seen["error"] and "checkpoint 1 is intact" in seen["error"]
    assert seen["first_step"] == 1 and seen["returned_step"] == 2 and seen["step_after_error"] == 1
    assert seen["checkpoints"] == [0, 1] and seen["leftovers"] == []
    assert seen["trajectory_files"] == ["0001.jsonl"] and seen["train_lines"] == [1]
    assert seen["served_after_error"] and seen["step_on_reload"] == 1
    assert seen["retried_step"] == 2 and seen["train_lines_at_end"] == [1, 2]
    assert "step 2 of disk was not committed (StorageFullError" in logs
    assert "rolled back to checkpoint 1" in logs
