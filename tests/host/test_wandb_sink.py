"""The W&B sink for real: `WANDB_MODE=offline`, then the run files wandb wrote are read back
(tests/helpers_wandb.py), after a real two-step run of the tiny model (tests/helpers_runs.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_core.backends import LocalBackend
from art_core.host.sinks import SinkRunner, StepRecord
from art_core.host.wandb_sink import RUN_FILE, TABLE_COLUMNS
from tests.helpers_runs import MODEL, PROJECT, build_run, user_text

pytest.importorskip("wandb")
from tests.helpers_wandb import logged_table, read_run, run_files  # noqa: E402

ASYNC = pytest.mark.asyncio(loop_scope="function")
ROOT = Path(__file__).resolve().parents[2]


async def _one_more_step(root: Path) -> int:
    """Register the same model in a new backend (a restarted process) and train one step."""

    async def rollout(model: TrainableModel, index: int) -> Trajectory:
        messages = [{"role": "user", "content": f"again {index}"}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4
        )
        return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=float(index))

    async with LocalBackend(root) as backend:
        model = TrainableModel(project=PROJECT, name=MODEL, base_model="tiny-random")
        await model.register(backend)
        groups = await gather_trajectory_groups(
            [TrajectoryGroup(rollout(model, i) for i in range(2))], pbar=False
        )
        result = await model.train(groups, config=TrainConfig(learning_rate=1e-2))
        return result.step


@ASYNC
async def test_steps_and_sample_tables_reach_one_resumed_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    run = await build_run(tmp_path / "art")
    model_dir = run.root / PROJECT / "models" / MODEL
    history = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
    run_id = json.loads((model_dir / RUN_FILE).read_text())["id"]

    (first,) = run_files(tmp_path / "wandb")
    offline = read_run(first)
    assert offline.run_id == run_id
    assert sorted(offline.rows) == [1, 2]
    for record in history:
        row = offline.rows[record["step"]]
        for key, value in record.items():
            if key != "step" and value is not None:
                assert row[key] == pytest.approx(value), key
    for step, split in ((1, "train"), (2, "train"), (2, "val")):
        data = logged_table(first.parent, offline.rows[step], f"samples/{split}")
        assert data["columns"] == TABLE_COLUMNS
        assert {row[0] for row in data["data"]} == {step} and {row[1] for row in data["data"]} == {split}
        texts = "\n".join(row[4] for row in data["data"])
        assert "user: " in texts and "assistant: " in texts
        if (step, split) == (1, "train"):
            assert user_text(0, 0) in texts or user_text(0, 3) in texts
        rewards = [row[3] for row in data["data"]]
        assert max(rewards) == max(
            t.reward for g in run.groups.get(step, run.val_groups) for t in g.trajectories
        )
    judged = logged_table(first.parent, offline.rows[2], "samples/train")
    assert any("judged" in row[5] for row in judged["data"])  # RULER's explanations, from the logs

    assert await _one_more_step(run.root) == 3
    files = run_files(tmp_path / "wandb")
    assert len(files) == 2
    resumed = read_run(next(f for f in files if f != first))
    assert resumed.run_id == run_id and 3 in resumed.rows
    assert resumed.rows[3]["train/reward"] == pytest.approx(0.5)


_BROKEN_RUN = """
import asyncio, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from tests.helpers_runs import build_run
asyncio.run(build_run(Path(sys.argv[1])))
"""


def test_a_broken_wandb_warns_once_and_training_records_every_step(tmp_path: Path) -> None:
    # Its own process: wandb keeps the settings it read first for the whole process, so an
    # invalid WANDB_MODE after another test's offline run would never be read.
    env = {**os.environ, "WANDB_MODE": "no-such-mode", "WANDB_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _BROKEN_RUN, str(tmp_path / "art")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history_path = tmp_path / "art" / PROJECT / "models" / MODEL / "history.jsonl"
    history = [json.loads(line) for line in history_path.read_text().splitlines()]
    assert [h["step"] for h in history if "trained" in h] == [1, 2]
    assert "val/reward" in history[-1]
    assert done.stderr.count("the wandb sink failed") == 1, done.stderr[-3000:]
    assert "ObserveConfig(wandb=False)" in done.stderr
    assert not run_files(tmp_path)


class _Failing:
    name = "flaky"

    def __init__(self) -> None:
        self.seen: list[int] = []

    def record(self, step: StepRecord) -> None:
        self.seen.append(step.step)
        raise ConnectionError("backend down")

    def close(self) -> None:
        raise ConnectionError("still down")


def test_the_runner_counts_each_failure_warns_once_and_keeps_feeding_the_sinks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = _Failing()
    runner = SinkRunner([failing], queue_size=1)
    with caplog.at_level(logging.WARNING, logger="art_core.host.sinks"):
        for step in (1, 2, 3):
            runner.submit(StepRecord("p", "m", step, "train", {"step": step}))
        runner.flush()
        assert runner.error_metrics() == {"observe/flaky_errors": 3.0}
        runner.close()
    assert failing.seen == [1, 2, 3] and runner.errors == {"flaky": 4}
    assert len([r for r in caplog.records if "flaky sink failed" in r.getMessage()]) == 1
