"""kill -9 a training run again and again; after each kill, restart the same command and check its state.

The run is `bench/crash_train.py --root ROOT --steps STEPS --model MODEL` (tiny model by default):
real rollouts through our server, `model.train`, checkpoints under ROOT. Each of `--kills` runs is
SIGKILLed in one window, cycling through
`rollout, train, save, trajectories, checkpoint, history, random`: the first six are hit
deliberately (the script kills itself inside the window, `ART_CRASH_AT`; see its docstring), `random`
is a SIGKILL from here at a random moment after the run reports that it resumed: uniform in
`--random-window-s` seconds, by default in one step's duration as measured in the earlier runs (a
fixed window let a fast CPU commit ten steps before the kill, and the later runs had nothing left
to train). After each kill, before restarting, every checkpoint on disk is loaded
(its safetensors and JSON files read back whole), and the next start must report:

- the step it resumed at == the newest complete checkpoint (and no step that reported `checkpoint`
  lost; `done` comes first when the commit runs in the background, so a step can be lost after it);
- `model.history()` with exactly one train line per step 1..s, and the trajectory files of 1..s,
  each parsed whole (none truncated);
- no temporary file anywhere under the model's folder.

A last run trains to `--steps` unkilled and the same checks run on its final state. The last line
printed is `{"kills", "resumes_ok", "corrupt", "lost_steps", ...}`.

Usage: python bench/crash_resume.py [--kills 20] [--model tiny-random] [--steps N] [--root DIR] [--seed 0]
       [--windows rollout,train,...] [--random-window-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "crash_train.py"
WINDOWS = ("rollout", "train", "save", "trajectories", "checkpoint", "history", "random")
RUN_TIMEOUT_S = 600.0


@dataclass
class Run:
    """One start of the training script: its process and the events it printed."""

    process: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    resumed: threading.Event = field(default_factory=threading.Event)
    times: list[float] = field(default_factory=list)
    """When each event arrived (time.monotonic), parallel to `events`."""
    resumed_at: float | None = None
    ended_at: float | None = None
    """When its output ended (it exited or was killed)."""

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                self.times.append(time.monotonic())
                self.events.append(event)
                if "resumed" in event:
                    self.resumed_at = self.times[-1]
                if "resumed" in event:
                    self.resumed.set()
        self.ended_at = time.monotonic()
        self.resumed.set()

    def committed_steps(self) -> int:
        """The newest step this run reported on disk (`checkpoint`; `done` can come before it)."""
        return max((e["step"] for e in self.events if e.get("phase") == "checkpoint"), default=0)

    def step_seconds(self, window: str) -> list[float]:
        """Each whole step this run took, from its rollout phase to its `done`; for a run killed
        just after its first commit (the `checkpoint` window), its time from resume to the kill."""
        started: dict[int, float] = {}
        seconds = []
        if window == "checkpoint" and self.resumed_at is not None and self.ended_at is not None:
            seconds.append(self.ended_at - self.resumed_at)
        for event, at in zip(self.events, self.times, strict=True):
            if event.get("phase") == "rollout":
                started.setdefault(event["step"], at)
            elif event.get("phase") == "done" and event["step"] in started:
                seconds.append(at - started[event["step"]])
        return seconds


def start(args: argparse.Namespace, crash_at: str | None) -> Run:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    env.pop("ART_CRASH_AT", None)
    if crash_at:
        env["ART_CRASH_AT"] = crash_at
    command = [
        sys.executable,
        str(SCRIPT),
        "--root",
        str(args.root),
        "--steps",
        str(args.steps),
        "--model",
        args.model,
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=HERE.parent
    )
    run = Run(process)
    threading.Thread(target=run.read, daemon=True).start()
    return run


def model_dir(root: Path) -> Path:
    return root / "crash" / "models" / "agent"


def checkpoint_problems(folder: Path) -> list[str]:
    """Every checkpoint's files read back whole: safetensors parsed, JSON parsed."""
    from safetensors.torch import load_file

    problems = []
    checkpoints = folder / "checkpoints"
    for path in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        if not path.name.isdigit():
            continue
        try:
            for name in ("adapter_model.safetensors", "optimizer.safetensors", "rng.safetensors"):
                load_file(str(path / name))
            json.loads((path / "trainer_state.json").read_text())
            json.loads((path / "adapter_config.json").read_text())
        except Exception as exc:  # noqa: BLE001 - any failure to load is what we count
            problems.append(f"checkpoint {path.name} does not load: {exc}")
    return problems


def latest_step(folder: Path) -> int:
    checkpoints = folder / "checkpoints"
    steps = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.is_dir() else []
    return max(steps, default=0)


def resume_problems(folder: Path, resumed: dict[str, Any] | None, expected: int) -> list[str]:
    """What is wrong with the state a restart reported (see the module docstring)."""
    from art_core.rollouts.groups import TrajectoryGroup

    if resumed is None:
        return ["the restarted run never reported that it resumed"]
    step, steps = resumed["resumed"], list(range(1, resumed["resumed"] + 1))
    problems = []
    if step != expected:
        problems.append(f"resumed at step {step}, but the newest complete checkpoint is {expected}")
    if resumed["history_steps"] != steps:
        problems.append(f"history's train steps are {resumed['history_steps']}, expected {steps}")
    if not set(steps) <= set(resumed["trajectory_steps"]):
        problems.append(f"trajectory files {resumed['trajectory_steps']} miss some of {steps}")
    if resumed["temporary"]:
        problems.append(f"temporary files left: {resumed['temporary']}")
    for s in steps:
        path = folder / "trajectories" / "train" / f"{s:04d}.jsonl"
        try:
            lines = path.read_text().splitlines()
            groups = [TrajectoryGroup.model_validate_json(line) for line in lines]
            if len(groups) != 2:
                problems.append(f"{path.name} holds {len(groups)} groups, expected 2")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{path.name} is unreadable: {exc}")
    return problems


def kill_one(args: argparse.Namespace, window: str, rng: random.Random, step_s: list[float]) -> Run:
    """Start the script, have it killed in `window`, wait until it is gone. `step_s`: the step
    durations measured so far (the random window's length when `--random-window-s` is 0)."""
    next_step = latest_step(model_dir(args.root)) + 1
    run = start(args, None if window == "random" else f"{window}:{next_step}")
    if window == "random":
        run.resumed.wait(RUN_TIMEOUT_S)
        span = args.random_window_s or (statistics.median(step_s) if step_s else 2.0)
        time.sleep(rng.uniform(0.0, span))
        if run.process.poll() is None:
            os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait(RUN_TIMEOUT_S)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--steps", type=int, default=0, help="the run's target step (default: kills + 2)")
    parser.add_argument(
        "--root", type=Path, default=None, help="where the run is stored (default: a temp dir)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-window-s",
        type=float,
        default=0.0,
        help="the random kill's window after the resume (default 0: one step, as measured)",
    )
    parser.add_argument(
        "--windows", default=",".join(WINDOWS), help="windows to cycle through, comma-separated"
    )
    args = parser.parse_args()
    windows = args.windows.split(",")
    if unknown := set(windows) - set(WINDOWS):
        parser.error(f"unknown windows {sorted(unknown)}; choose from {WINDOWS}")
    args.steps = args.steps or args.kills + 2
    args.root = args.root or Path(tempfile.mkdtemp(prefix="crash-resume-"))
    rng = random.Random(args.seed)
    print(machine_header(), flush=True)
    print(f"run: {SCRIPT.name} --model {args.model} --steps {args.steps} under {args.root}", flush=True)
    folder = model_dir(args.root)
    kills = resumes_ok = corrupt = lost = missed = 0
    step_s: list[float] = []
    done_before = 0
    by_window: dict[str, int] = {}
    for index in range(args.kills + 1):
        last = index == args.kills
        window = "" if last else windows[index % len(windows)]
        expected = latest_step(folder)
        run = start(args, None) if last else kill_one(args, window, rng, step_s)
        if last:
            run.process.wait(RUN_TIMEOUT_S * 3)  # the last run trains the remaining steps
        killed = run.process.returncode == -signal.SIGKILL
        run.process.wait()
        time.sleep(0.05)  # the reader thread sees the end of the output
        step_s.extend(run.step_seconds(window))
        if not last and not killed:
            missed += 1
        resumed = next((e for e in run.events if "resumed" in e), None)
        problems = resume_problems(folder, resumed, expected) if index else []
        if resumed is not None and resumed["resumed"] < done_before:
            lost += done_before - resumed["resumed"]
        if index:
            resumes_ok += not problems
            corrupt += bool(problems)
        problems += checkpoint_problems(folder)
        if killed:
            kills += 1
            by_window[window] = by_window.get(window, 0) + 1
        done_before = max(done_before, run.committed_steps(), resumed["resumed"] if resumed else 0)
        status = "killed" if killed else f"exit {run.process.returncode}"
        print(
            f"run {index:2d} window={window or 'none':12s} {status:8s} resumed at {resumed and resumed['resumed']}"
            f" committed {latest_step(folder)}" + (f"  PROBLEMS: {problems}" if problems else ""),
            flush=True,
        )
    final = {"resumed": latest_step(folder), **json.loads(json.dumps(final_view(folder)))}
    final_problems = resume_problems(folder, final, args.steps) + checkpoint_problems(folder)
    corrupt += bool(final_problems)
    if final_problems:
        print(f"final state PROBLEMS: {final_problems}")
    if missed:
        print(
            f"warning: {missed} of {args.kills} runs ended before their kill window: raise --steps "
            f"(now {args.steps}) so every run has a step left to be killed in",
            flush=True,
        )
    print(
        json.dumps(
            {
                "kills": kills,
                "resumes_ok": resumes_ok,
                "corrupt": corrupt,
                "lost_steps": lost,
                "kills_by_window": by_window,
                "runs_not_killed": missed,
                "final_step": latest_step(folder),
                "model": args.model,
            }
        )
    )


def final_view(folder: Path) -> dict[str, Any]:
    """The view `crash_train.py` reports on resume, read from disk here (the last run's end state)."""
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    trajectories = folder / "trajectories" / "train"
    return {
        "history_steps": [r["step"] for r in history if "trained" in r],
        "trajectory_steps": sorted(int(p.stem) for p in trajectories.glob("*.jsonl")),
        "temporary": sorted(str(p.relative_to(folder)) for p in folder.rglob(".tmp-*")),
    }


if __name__ == "__main__":
    main()
