"""On-disk layout of a trained model, with atomic writes.

```
<base>/<project>/models/<name>/
    model.json                     what the model is (base model, LoRA config, ...)
    history.jsonl                  one JSON line of metrics per step
    checkpoints/<step:04d>/        peft adapter + optimizer and RNG state (see `Trainer.save_state`)
                                   and step_record.json (the step's history line, as of the checkpoint)
    trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line
```
Every write is atomic (`art_core.atomic`, re-exported here): a file is written to a temporary name
in the same folder, fsynced and renamed over the target; a checkpoint folder is filled under a
temporary name (`.tmp-...`) and renamed into place, so a crash leaves either the old state or the
new one, never half of one. Served names (`name`, `name@step`) are built and parsed here too.
History lines are appended with one `write` and fsynced (a failed write is truncated away); a torn
last line (a crash mid-append) is skipped when reading.

A train step counts once its checkpoint folder is renamed into place (`commit_step`): its
trajectories file is written before, and its history line travels inside the checkpoint
(`step_record.json`), so a crash at any moment leaves either an uncommitted step (redone on resume)
or a committed one whose record `recover` completes. `recover` (run when a model is loaded) also
drops a torn last history line, duplicate or uncommitted train lines, trajectories of uncommitted
steps and leftover temporary files.
"""

from __future__ import annotations

import errno
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
STEP_RECORD = "step_record.json"
"""The file inside a checkpoint folder holding the step's history line (see `commit_step`)."""
STEP_REQUEST = "request.json"
"""The file inside a checkpoint folder holding the idempotency key of the train request that made it."""
TRAIN_SPLIT = "train"

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errnos of a write that found no room: the filesystem is full, a quota or a file size limit."""


_NO_ROOM = {
    errno.ENOSPC: "the filesystem is full that holds",
    errno.EDQUOT: "the disk quota is used up for",
    errno.EFBIG: "a file size limit (ulimit -f) stops writes to",
}
_OS_ERROR = re.compile(r"os error (\d+)")
"""How Rust libraries (safetensors) report an errno inside their own exception types."""


def _full_errno(exc: BaseException) -> int | None:
    """The errno of `exc` (or of its causes) when it says the filesystem had no room, else None.

    An OSError carries it in `errno`; safetensors raises its own error type whose message ends in
    "(os error 28)"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            return seen.errno
        match = _OS_ERROR.search(str(seen))
        if match and int(match.group(1)) in _FULL:
            return int(match.group(1))
        seen = seen.__cause__ or seen.__context__
    return None


class StorageFullError(OSError):
    """A step could not be committed because its filesystem is full (ENOSPC, a quota, a size limit).

    An OSError with the original errno and file name; the message says which step and folder, that
    nothing of the step was kept and which checkpoint is still the newest."""


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
        """Remove leftovers of writes that crashed before their rename.

        A prefix test, not `glob(prefix + "*")`: each step's prefix is new, and glob compiles and
        caches a regular expression per pattern (re's, fnmatch's and pathlib's caches): ~0.75 KB a
        step kept by a long run (tests/storage/test_checkpoints.py), bounded only by those caches.
        """
        for path in [p for p in self.checkpoints_dir.iterdir() if p.name.startswith(prefix)]:
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
        """Append one JSON line to history.jsonl (one write, fsynced). NaN/inf are written as null.

        The line goes out in a single `write` on an O_APPEND descriptor, so a killed process leaves the
        whole line or none of it; a short or failed write (a full disk) is truncated away before the
        error propagates, so the file never ends in half a line.
        """
        data = (_dumps(record) + "\n").encode("utf-8")
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"short write to {self.history_path}: {written} of {len(data)} bytes")
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def commit_step(
        self,
        step: int,
        groups: Sequence[TrajectoryGroup],
        save_state: Callable[[Path], None],
        record: Callable[[], dict[str, Any]],
        request_key: str | None = None,
    ) -> Path:
        """Make train step `step` count: its trajectories file, then its checkpoint with `record()`
        (the history line, built after `save_state` so it can time it) inside as `step_record.json`.

        The checkpoint's rename is the commit: a crash before it leaves an uncommitted step (its
        trajectories file is removed by `recover`), a crash after it a committed step whose history
        line `recover` appends from the checkpoint if the caller's `append_history` did not happen.
        `request_key` (a client's idempotency key) is stored beside it (`request_key(step)`).

        A write that fails leaves nothing of the step: its temporary files and its trajectories file
        are removed before the error propagates; a full filesystem is a `StorageFullError`.
        """

        def write(folder: Path) -> None:
            save_state(folder)
            (folder / STEP_RECORD).write_text(_dumps(record()) + "\n", encoding="utf-8")
            if request_key is not None:
                (folder / STEP_REQUEST).write_text(json.dumps({"request_key": request_key}), encoding="utf-8")

        trajectories = self.root / "trajectories" / TRAIN_SPLIT / f"{step:04d}.jsonl"
        try:
            self.write_trajectories(TRAIN_SPLIT, step, groups)
            return self.write_checkpoint(step, write)
        except Exception as exc:
            trajectories.unlink(missing_ok=True)
            code = _full_errno(exc)
            if code is None:
                raise
            newest = max((s for s in self.steps() if s < step), default=None)
            kept = (
                f"checkpoint {newest} is intact and still the newest"
                if newest is not None
                else "no earlier checkpoint exists"
            )
            where = getattr(exc, "filename", None) or self.checkpoint_dir(step)
            raise StorageFullError(
                code,
                f"{_NO_ROOM[code]} {self.root} ({os.strerror(code)}) while writing {where} "
                f"for step {step}: step {step} was not committed and nothing of it was kept; {kept}. "
                "Free space (or delete old checkpoints) and train the step again",
            ) from exc

    def step_record(self, step: int) -> dict[str, Any] | None:
        """The history line stored in checkpoint `step` by `commit_step` (None: none stored)."""
        path = self.checkpoint_dir(step) / STEP_RECORD
        if not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None

    def request_key(self, step: int) -> str | None:
        """The idempotency key of the train request that committed `step` (None: none given)."""
        path = self.checkpoint_dir(step) / STEP_REQUEST
        if not path.is_file():
            return None
        key = json.loads(path.read_text(encoding="utf-8")).get("request_key")
        return key if isinstance(key, str) else None

    def recover(self) -> list[str]:
        """Repair what a crash can leave (see the module docstring); return what was repaired, one
        line each (also logged as warnings). Run it before training resumes, in the one process that
        writes this model."""
        repairs = _remove_temporary_files(self) + _drop_uncommitted_trajectories(self) + _repair_history(self)
        for line in repairs:
            logger.warning("%s: %s", self.root, line)
        return repairs

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


# -- recovery after a crash (ModelStorage.recover) ---------------------------------------------------


def _remove_temporary_files(storage: ModelStorage) -> list[str]:
    """Temporary files and folders of writes that never reached their rename."""
    folders = [storage.root, storage.checkpoints_dir]
    trajectories = storage.root / "trajectories"
    if trajectories.is_dir():
        folders.extend(p for p in trajectories.iterdir() if p.is_dir())
    repairs = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob(_TEMP_PREFIX + "*")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            repairs.append(f"removed the temporary {path.relative_to(storage.root)} of an interrupted write")
    return repairs


def _drop_uncommitted_trajectories(storage: ModelStorage) -> list[str]:
    """Train trajectories of steps whose checkpoint was never committed (the step will be redone)."""
    folder = storage.root / "trajectories" / TRAIN_SPLIT
    if not folder.is_dir():
        return []
    latest, repairs = storage.latest_step(), []
    for path in sorted(folder.glob("*.jsonl")):
        if path.stem.isdigit() and int(path.stem) > latest:
            path.unlink()
            repairs.append(
                f"removed {path.relative_to(storage.root)}: step {int(path.stem)} was never checkpointed"
            )
    return repairs


def _is_train_line(record: dict[str, Any]) -> bool:
    """A train step's history line (`model.log` lines carry `<split>/...` keys, never `trained`)."""
    return "trained" in record and isinstance(record.get("step"), int)


def _repair_history(storage: ModelStorage) -> list[str]:
    """One valid train line per committed step, nothing after a torn end; rewritten atomically if changed."""
    path = storage.history_path
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    lines = text.splitlines()
    repairs: list[str] = []
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number != len(lines):
                raise ValueError(f"{path}:{number} is not valid JSON: {error}") from None
            repairs.append(f"dropped the torn last line {number} of history.jsonl ({error})")
            continue
        records.append(record)
    committed = set(storage.steps())
    kept, seen = [], set()
    for record in records:
        if _is_train_line(record):
            step = record["step"]
            if step not in committed and step > storage.latest_step():
                repairs.append(f"dropped history's line for step {step}: that step was never checkpointed")
                continue
            if step in seen:
                repairs.append(f"dropped a second history line for step {step}")
                continue
            seen.add(step)
        kept.append(record)
    for step in sorted(committed - seen):
        stored = storage.step_record(step)
        if stored is not None:
            kept.append(stored)
            repairs.append(
                f"appended step {step}'s history line from its checkpoint (the run stopped before it)"
            )
    changed = bool(repairs) or (bool(text) and not text.endswith("\n"))
    if changed:
        atomic_write_bytes(path, "".join(_dumps(r) + "\n" for r in kept).encode("utf-8"))
    return repairs


__all__ = [
    "DEFAULT_BASE_DIR",
    "STEP_RECORD",
    "STEP_REQUEST",
    "InvalidServedNameError",
    "StorageFullError",
    "ModelStorage",
    "atomic_dir",
    "atomic_write_bytes",
    "fsync_dir",
    "parse_served_name",
    "served_name",
    "validate_name",
]
