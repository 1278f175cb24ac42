"""`ModelStorage.commit_step` and `recover`: what a crash at each moment of a step leaves, repaired."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.storage import STEP_RECORD, ModelStorage, StorageFullError


@pytest.fixture
def storage(tmp_path: Path) -> ModelStorage:
    return ModelStorage.create(tmp_path, "demo", "agent-001")


def groups(reward: float) -> list[TrajectoryGroup]:
    turn = Turn(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])
    return [
        TrajectoryGroup(
            [Trajectory(messages=[{"role": "user", "content": "hi"}], turns=[turn], reward=reward)]
        )
    ]


def save(folder: Path) -> None:
    (folder / "weights.safetensors").write_bytes(b"w")


def commit(storage: ModelStorage, step: int, *, append: bool = True) -> dict[str, object]:
    record = {"step": step, "trained": 1, "loss/train": 0.5 * step}
    storage.commit_step(step, groups(step / 10), save, lambda: record)
    if append:
        storage.append_history(record)
    return record


def history_lines(storage: ModelStorage) -> list[dict[str, object]]:
    return [json.loads(line) for line in storage.history_path.read_text().splitlines()]


def test_commit_step_writes_trajectories_and_the_record_inside_the_checkpoint(storage: ModelStorage) -> None:
    record = commit(storage, 1, append=False)
    assert storage.steps() == [1]
    assert json.loads((storage.checkpoint_dir(1) / STEP_RECORD).read_text()) == record
    assert storage.read_trajectories("train", 1)[0].trajectories[0].reward == 0.1
    assert storage.recover() == [
        "appended step 1's history line from its checkpoint (the run stopped before it)"
    ]
    assert history_lines(storage) == [record]
    assert storage.recover() == []  # idempotent: nothing left to repair


def test_a_save_that_raises_commits_nothing(storage: ModelStorage) -> None:
    def broken(folder: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageFullError, match="No space left on device.*step 1 was not committed") as full:
        storage.commit_step(1, groups(0.1), broken, dict)
    assert full.value.errno == errno.ENOSPC and isinstance(full.value, OSError)
    assert storage.steps() == [] and not list(storage.checkpoints_dir.iterdir())
    # the trajectories file was written first; the failed commit removed it, so recover has nothing to do
    assert not (storage.root / "trajectories" / "train" / "0001.jsonl").exists()
    assert storage.recover() == []


def test_a_crash_between_trajectories_and_checkpoint_is_repaired_by_recover(storage: ModelStorage) -> None:
    storage.write_trajectories("train", 1, groups(0.1))  # what a kill right after this write leaves
    assert storage.recover() == ["removed trajectories/train/0001.jsonl: step 1 was never checkpointed"]
    assert not (storage.root / "trajectories" / "train" / "0001.jsonl").exists()


def test_a_save_that_fails_otherwise_keeps_its_error_and_commits_nothing(storage: ModelStorage) -> None:
    def broken(folder: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        storage.commit_step(1, groups(0.1), broken, dict)
    assert storage.steps() == [] and storage.recover() == []


def test_recover_drops_a_torn_last_line_and_keeps_a_newline_ending(storage: ModelStorage) -> None:
    first = commit(storage, 1)
    with open(storage.history_path, "a") as handle:
        handle.write('{"step": 2, "trai')
    (repair,) = storage.recover()
    assert repair.startswith("dropped the torn last line 2 of history.jsonl")
    assert storage.history_path.read_text() == json.dumps(first) + "\n"


def test_recover_drops_duplicates_and_uncommitted_train_lines_but_keeps_logged_lines(
    storage: ModelStorage,
) -> None:
    first = commit(storage, 1)
    storage.append_history(first)  # a second line for step 1
    storage.append_history({"step": 1, "val/reward": 0.3})  # model.log at the same step: kept
    storage.append_history({"step": 2, "trained": 1})  # step 2 never checkpointed
    assert storage.recover() == [
        "dropped a second history line for step 1",
        "dropped history's line for step 2: that step was never checkpointed",
    ]
    assert history_lines(storage) == [first, {"step": 1, "val/reward": 0.3}]


def test_recover_removes_temporary_files_everywhere(storage: ModelStorage) -> None:
    commit(storage, 1)
    (storage.checkpoints_dir / ".tmp-0002-abc").mkdir()
    (storage.checkpoints_dir / ".tmp-0002-abc" / "x").write_bytes(b"half")
    (storage.root / "trajectories" / "train" / ".tmp-0002.jsonl.x").write_bytes(b"{")
    (storage.root / ".tmp-history.jsonl.y").write_bytes(b"")
    repairs = storage.recover()
    assert len(repairs) == 3 and all("temporary" in r for r in repairs)
    assert not list(storage.root.rglob(".tmp-*"))
    assert storage.steps() == [1]


def test_append_history_truncates_a_failed_write(
    storage: ModelStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = commit(storage, 1)
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:  # a disk that fills mid-line
        return real_write(fd, data[:5])

    monkeypatch.setattr(os, "write", short_write)
    with pytest.raises(OSError, match="short write"):
        storage.append_history({"step": 2, "trained": 1})
    monkeypatch.undo()
    assert storage.history_path.read_text() == json.dumps(first) + "\n"
