"""Runs stored on disk, read back for `art runs`, `art report` and `art trajectories`.

A run is one model's folder in the storage layout of `art_core.storage`
(`<root>/<project>/models/<name>/`). Its history.jsonl may hold several lines per step (the train
record, then `model.log` lines for val or extra metrics); `merged_history` folds them into one
row per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.storage import ModelStorage, validate_name

SUMMARY_KEYS = ("train/reward", "val/reward", "loss/train", "loss/grad_norm", "time/step_s")
"""The latest metrics `art runs` shows (when a run has them)."""


class RunNotFoundError(LookupError):
    """No stored run under the given root and name."""


@dataclass(frozen=True)
class RunSummary:
    """One stored model and where its run stands."""

    project: str
    """The project folder."""
    model: str
    """The model's name."""
    path: Path
    """The model's folder."""
    latest_step: int
    """The highest step with a checkpoint (0: none)."""
    history_steps: list[int]
    """Steps that have a history record, ascending."""
    latest: dict[str, float] = field(default_factory=dict)
    """The last value of each of `SUMMARY_KEYS` that the history holds."""

    def as_json(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "model": self.model,
            "path": str(self.path),
            "latest_step": self.latest_step,
            "history_steps": self.history_steps,
            "latest": self.latest,
        }


def parse_run_name(name: str) -> tuple[str, str]:
    """`"PROJECT/MODEL"` -> (project, model), both validated as storage names; ValueError otherwise."""
    project, sep, model = name.partition("/")
    if not sep:
        raise ValueError(f"{name!r}: name the run as PROJECT/MODEL (e.g. 'demo/demo-001'); see `art runs`")
    return validate_name(project, "project name"), validate_name(model, "model name")


def open_run(root: Path, name: str) -> ModelStorage:
    """The storage of run `PROJECT/MODEL` under `root`; RunNotFoundError if it was never written."""
    project, model = parse_run_name(name)
    folder = Path(root) / project / "models" / model
    if not folder.is_dir():
        raise RunNotFoundError(f"no run {name!r} under {root}: list the stored runs with `art runs {root}`")
    return ModelStorage(folder)


def merged_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, ascending: the records of a step merged in order (later values win)."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records:
        step = record.get("step")
        if isinstance(step, int):
            rows.setdefault(step, {}).update(record)
    return [rows[step] for step in sorted(rows)]


def latest_metrics(rows: list[dict[str, Any]], keys: tuple[str, ...] = SUMMARY_KEYS) -> dict[str, float]:
    """The last finite value of each of `keys` in `rows`."""
    out: dict[str, float] = {}
    for row in rows:
        for key in keys:
            value = row.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                out[key] = float(value)
    return out


def find_runs(root: Path) -> list[RunSummary]:
    """Every model folder under `root` (`<project>/models/<name>`), sorted by project and name."""
    runs = []
    for folder in sorted(Path(root).glob("*/models/*")):
        if not folder.is_dir():
            continue
        storage = ModelStorage(folder)
        rows = merged_history(storage.read_history())
        runs.append(
            RunSummary(
                project=folder.parent.parent.name,
                model=folder.name,
                path=folder,
                latest_step=storage.latest_step(),
                history_steps=[int(row["step"]) for row in rows],
                latest=latest_metrics(rows),
            )
        )
    return runs


def trajectory_steps(storage: ModelStorage, split: str) -> list[int]:
    """Steps with a `trajectories/<split>/<step>.jsonl` file, ascending."""
    validate_name(split, "split name")
    folder = storage.root / "trajectories" / split
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.jsonl") if p.stem.isdigit())


def step_groups(storage: ModelStorage, split: str, step: int) -> list[TrajectoryGroup]:
    """The groups stored for `step` of `split`; RunNotFoundError (listing the steps there are) if none."""
    if step not in trajectory_steps(storage, split):
        have = ", ".join(map(str, trajectory_steps(storage, split))) or "none"
        raise RunNotFoundError(f"no {split} trajectories for step {step} in {storage.root} (steps: {have})")
    return storage.read_trajectories(split, step)


def ranked(groups: list[TrajectoryGroup]) -> list[Trajectory]:
    """The rewarded trajectories of `groups`, highest reward first (stable within equal rewards)."""
    rewarded = [t for g in groups for t in g.trajectories if t.reward is not None]
    return sorted(rewarded, key=lambda t: -float(t.reward or 0.0))


def best_and_worst(groups: list[TrajectoryGroup], count: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """The `count` best trajectories and the `count` worst (worst first), by reward."""
    order = ranked(groups)
    return order[:count], list(reversed(order))[:count]
