"""On-disk layout of a trained model, with atomic writes.

```
<base>/<project>/models/<name>/
    model.json                     what the model is (base model, LoRA config, ...)
    history.jsonl                  one JSON line of metrics per step
    checkpoints/<step:04d>/        peft adapter + optimizer and RNG state (see `Trainer.save_state`)
    trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line
```
Every write is atomic (`art_core.atomic`, re-exported here): a file is written to a temporary name
in the same folder, fsynced and renamed over the target; a checkpoint folder is filled under a
temporary name (`.tmp-...`) and renamed into place, so a crash leaves either the old state or the
new one, never half of one. Served names (`name`, `name@step`) are built and parsed here too.
History lines are appended, flushed and fsynced; a torn last line (a crash mid-append) is skipped
when reading.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_core.atomic import atomic_dir, atomic_write_bytes, fsync_dir
from art_core.rollouts.groups import TrajectoryGroup

logger = logging.getLogger(__name__)

DEFAULT_BASE_DIR = Path(".art")
"""Where models are stored when no base folder is given."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TEMP_PREFIX = ".tmp-"


def validate_name(name: str, what: str) -> str:
    """Return `name` if it is safe as one path component, else raise ValueError saying what is allowed."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"invalid {what} {name!r}: use 1-128 characters from letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, without '..' or path separators (e.g. 'agent-001')"
        )
    return name


class InvalidServedNameError(ValueError):
    """A served model name that is neither `name` nor `name@step` (step in ASCII digits)."""


def served_name(name: str, step: int | None = None) -> str:
    """The name a model is served as: `name` for its latest weights, `name@step` for a checkpoint."""
    return name if step is None else f"{name}@{int(step)}"


def parse_served_name(text: str) -> tuple[str, int | None]:
    """`name` -> (name, None), `name@7` -> (name, 7); the one parser of served names.

    Raises InvalidServedNameError for anything else (`name@`, `name@x`, `name@-1`, `name@1@2`, and
    `name@²`, whose superscript `str.isdigit` accepts but `int` refuses).
    """
    name, sep, step_text = text.partition("@")
    if not sep:
        return name, None
    if not (step_text.isascii() and step_text.isdigit()):
        raise InvalidServedNameError(
            f"{text!r} is not a served model name: use `name` for the latest weights or `name@step` "
            "with the step in ASCII digits (e.g. 'agent-001@3')"
        )
    return name, int(step_text)


def _json_safe(value: Any) -> Any:
    """Non-finite floats become null, so every line is standard JSON (readable by jq, pandas, JS)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _dumps(data: Any) -> str:
    return json.dumps(_json_safe(data), allow_nan=False)


@dataclass(frozen=True)
class ModelStorage:
    """The folder of one model of one project; see the module docstring for the layout."""

    root: Path
    """`<base>/<project>/models/<name>`."""

    @classmethod
    def create(cls, base: Path | str | None, project: str, name: str) -> ModelStorage:
        """Storage for `project`/`name` under `base` (None: `.art`); validates both names, creates the folder."""
        validate_name(project, "project name")
        validate_name(name, "model name")
        root = Path(base if base is not None else DEFAULT_BASE_DIR) / project / "models" / name
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def history_path(self) -> Path:
        return self.root / "history.jsonl"

    def checkpoint_dir(self, step: int) -> Path:
        """`checkpoints/<step:04d>` (whether or not it exists)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.checkpoints_dir / f"{step:04d}"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending; temporary and unrelated folders are ignored."""
        if not self.checkpoints_dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.checkpoints_dir.iterdir() if p.is_dir() and p.name.isdigit())

    def latest_step(self) -> int:
        """The highest checkpointed step, 0 when there is none."""
        steps = self.steps()
        return steps[-1] if steps else 0

    def write_checkpoint(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call `write(folder)` on a temporary folder, fsync it, rename it to `checkpoint_dir(step)`.

        If `write` raises, the temporary folder is removed and nothing changes. Refuses to replace
        an existing checkpoint (delete it first).
        """
        final = self.checkpoint_dir(step)
        if final.exists():
            raise FileExistsError(
                f"checkpoint {final} already exists; delete it before writing step {step} again"
            )
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries(f"{_TEMP_PREFIX}{step:04d}-")
        with atomic_dir(final, temp_prefix=f"{_TEMP_PREFIX}{step:04d}-") as temp:
            write(temp)
        return final

    def _remove_temporaries(self, prefix: str) -> None:
        """Remove leftovers of writes that crashed before their rename."""
        for path in self.checkpoints_dir.glob(prefix + "*"):
            logger.info("removing incomplete checkpoint folder %s", path)
            shutil.rmtree(path, ignore_errors=True)

    def delete_checkpoints(self, keep: Iterable[int]) -> list[int]:
        """Delete every checkpoint whose step is not in `keep`; return the deleted steps.

        Each folder is first renamed to a temporary name, so a crash mid-delete never leaves a
        half-deleted folder that looks like a checkpoint.
        """
        kept = set(keep)
        deleted = []
        for step in self.steps():
            if step in kept:
                continue
            doomed = self.checkpoints_dir / f"{_TEMP_PREFIX}delete-{step:04d}-{uuid.uuid4().hex[:8]}"
            os.rename(self.checkpoint_dir(step), doomed)
            shutil.rmtree(doomed)
            deleted.append(step)
        if deleted:
            fsync_dir(self.checkpoints_dir)
        return deleted

    def append_history(self, record: dict[str, Any]) -> None:
        """Append one JSON line to history.jsonl (flushed and fsynced). NaN/inf are written as null."""
        line = _dumps(record)
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.history_path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def read_history(self) -> list[dict[str, Any]]:
        """All history records in order. A torn last line is skipped (logged); a bad earlier line raises."""
        if not self.history_path.exists():
            return []
        lines = self.history_path.read_text(encoding="utf-8").splitlines()
        records = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                if number == len(lines):
                    logger.warning("%s: ignoring torn last line %d (%s)", self.history_path, number, error)
                    continue
                raise ValueError(f"{self.history_path}:{number} is not valid JSON: {error}") from None
        return records

    def write_trajectories(self, split: str, step: int, groups: Sequence[TrajectoryGroup]) -> Path:
        """Write `trajectories/<split>/<step:04d>.jsonl` atomically, one group per line."""
        validate_name(split, "split name")
        path = self.root / "trajectories" / split / f"{step:04d}.jsonl"
        text = "".join(group.model_dump_json() + "\n" for group in groups)
        atomic_write_bytes(path, text.encode("utf-8"))
        return path

    def read_trajectories(self, split: str, step: int) -> list[TrajectoryGroup]:
        """The groups written by `write_trajectories`."""
        validate_name(split, "split name")
        path = self.root / "trajectories" / split / f"{step:04d}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        return [TrajectoryGroup.model_validate_json(line) for line in lines if line.strip()]

    def _inside(self, relpath: str) -> Path:
        parts = Path(relpath).parts
        if not parts or Path(relpath).is_absolute() or any(part in ("..", ".") for part in parts):
            raise ValueError(f"{relpath!r} must be a relative path inside the model folder, without '..'")
        return self.root.joinpath(*parts)

    def write_json(self, relpath: str, data: dict[str, Any]) -> None:
        """Write `data` as JSON to `root/relpath` atomically (e.g. "model.json")."""
        atomic_write_bytes(self._inside(relpath), (json.dumps(_json_safe(data), indent=2) + "\n").encode())

    def read_json(self, relpath: str) -> dict[str, Any]:
        """Read a JSON file written by `write_json`; FileNotFoundError if absent."""
        data = json.loads(self._inside(relpath).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{self._inside(relpath)} holds {type(data).__name__}, expected a JSON object")
        return data


__all__ = [
    "DEFAULT_BASE_DIR",
    "InvalidServedNameError",
    "ModelStorage",
    "atomic_dir",
    "atomic_write_bytes",
    "fsync_dir",
    "parse_served_name",
    "served_name",
    "validate_name",
]
