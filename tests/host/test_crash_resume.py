"""kill -9 of a real training process (bench/crash_train.py) in each window of a step, then the same
command again: the run resumes at the last committed step with one history line and one trajectory
file per step (issue 18). The kill is a real SIGKILL of a subprocess, sent by itself from inside the
window (`ART_CRASH_AT`, see the script's docstring)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from art_core.storage import ModelStorage

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "crash_train.py"
TIMEOUT_S = 300


def run_script(root: Path, steps: int, crash_at: str | None = None) -> tuple[int, list[dict[str, Any]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ART_CRASH_AT", None)
    if crash_at:
        env["ART_CRASH_AT"] = crash_at
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events


@pytest.mark.parametrize("window", ["checkpoint", "history"])
def test_a_kill_in_a_step_window_resumes_with_a_complete_record(tmp_path: Path, window: str) -> None:
    code, events = run_script(tmp_path, 3, f"{window}:2")
    assert code == -signal.SIGKILL, events
    committed = 2 if window in ("checkpoint", "history") else 1
    assert "finished" not in events[-1]  # the commit runs during step 3's rollouts: the kill can follow them
    assert [e["step"] for e in events if e.get("phase") == "checkpoint"] == [1, 2]

    code, events = run_script(tmp_path, 3)
    assert code == 0, events
    resumed = events[0]
    steps = list(range(1, committed + 1))
    assert resumed == {
        "resumed": committed,
        "history_steps": steps,
        "trajectory_steps": steps,
        "temporary": [],
    }
    assert events[-1] == {"finished": 3}

    storage = ModelStorage.create(tmp_path, "crash", "agent")
    lines = storage.history_path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # one line per step, none torn
    assert storage.steps() == [0, 1, 2, 3]
    for step in (1, 2, 3):
        groups = storage.read_trajectories("train", step)
        assert len(groups) == 2 and all(len(g.trajectories) == 3 for g in groups)
    assert not list(storage.root.rglob(".tmp-*"))
