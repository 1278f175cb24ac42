"""Storage layout: name validation, atomic writes, interrupted checkpoints, history, deletion."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc
from pathlib import Path

import pytest

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.storage import ModelStorage, atomic_write_bytes, validate_name


@pytest.fixture
def storage(tmp_path: Path) -> ModelStorage:
    return ModelStorage.create(tmp_path, "demo", "agent-001")


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "name", ["../x", "a/b", "a\\b", "", ".hidden", "x" * 129, "a..b", "-dash", "sp ace", "é"]
)
def test_validate_name_rejects_unsafe_names(name: str) -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        validate_name(name, "model name")


@pytest.mark.parametrize("name", ["agent-001", "a", "Qwen2.5_7B", "x" * 128])
def test_validate_name_accepts_safe_names(name: str) -> None:
    assert validate_name(name, "model name") == name


def test_create_builds_the_layout_and_rejects_bad_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = ModelStorage.create(tmp_path, "demo", "agent-001")
    assert storage.root == tmp_path / "demo" / "models" / "agent-001" and storage.root.is_dir()
    with pytest.raises(ValueError, match="project name"):
        ModelStorage.create(tmp_path, "../evil", "agent")
    monkeypatch.chdir(tmp_path)
    assert ModelStorage.create(None, "demo", "m").root == Path(".art/demo/models/m")
    assert (tmp_path / ".art" / "demo" / "models" / "m").is_dir()


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "model.json"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert all_files(tmp_path) == ["sub", "sub/model.json"]


def test_checkpoint_write_is_atomic(storage: ModelStorage) -> None:
    assert storage.latest_step() == 0 and storage.steps() == []
    path = storage.write_checkpoint(1, lambda d: (d / "weights.safetensors").write_bytes(b"w"))
    assert (
        path == storage.root / "checkpoints" / "0001" and (path / "weights.safetensors").read_bytes() == b"w"
    )
    assert storage.latest_step() == 1
    assert all_files(storage.root / "checkpoints") == ["0001", "0001/weights.safetensors"]
    with pytest.raises(FileExistsError):
        storage.write_checkpoint(1, lambda d: None)


def test_interrupted_checkpoint_write_leaves_nothing(storage: ModelStorage) -> None:
    storage.write_checkpoint(1, lambda d: (d / "a").write_text("ok"))

    def crash(directory: Path) -> None:
        (directory / "half").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        storage.write_checkpoint(2, crash)
    assert storage.latest_step() == 1 and not storage.checkpoint_dir(2).exists()
    assert all_files(storage.root / "checkpoints") == ["0001", "0001/a"]


def test_stale_temporary_folders_are_ignored_and_cleaned(storage: ModelStorage) -> None:
    stale = storage.root / "checkpoints" / ".tmp-0003-deadbeef"
    stale.mkdir(parents=True)
    (storage.root / "checkpoints" / "notes").mkdir()
    assert storage.steps() == [] and storage.latest_step() == 0
    storage.write_checkpoint(3, lambda d: None)
    assert storage.steps() == [3] and not stale.exists()


def test_delete_checkpoints_keeps_requested(storage: ModelStorage) -> None:
    for step in (0, 1, 2, 3, 10):
        storage.write_checkpoint(step, lambda d: (d / "x").write_text("x"))
    assert storage.delete_checkpoints(keep=[0, 3]) == [1, 2, 10]
    assert storage.steps() == [0, 3] and storage.latest_step() == 3
    assert all_files(storage.root / "checkpoints") == ["0000", "0000/x", "0003", "0003/x"]


def test_history_append_and_read(storage: ModelStorage) -> None:
    assert storage.read_history() == []
    storage.append_history({"step": 1, "reward": 0.5})
    storage.append_history({"step": 2, "reward": math.nan, "loss": math.inf})
    assert storage.read_history() == [{"step": 1, "reward": 0.5}, {"step": 2, "reward": None, "loss": None}]
    lines = (storage.root / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # standard JSON, one line per step


def test_history_skips_a_torn_last_line_but_not_a_corrupt_middle(storage: ModelStorage) -> None:
    storage.append_history({"step": 1})
    with open(storage.root / "history.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')
    assert storage.read_history() == [{"step": 1}]
    with open(storage.root / "history.jsonl", "a") as handle:
        handle.write("\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match="history.jsonl:2"):
        storage.read_history()


def test_trajectories_round_trip(storage: ModelStorage) -> None:
    turn = Turn(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])
    groups = [
        TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": "hi"}], turns=[turn], reward=1.0)])
    ]
    path = storage.write_trajectories("train", 7, groups)
    assert path == storage.root / "trajectories" / "train" / "0007.jsonl"
    [group] = storage.read_trajectories("train", 7)
    assert group.trajectories[0].turns == [turn] and group.trajectories[0].reward == 1.0
    with pytest.raises(ValueError, match="split name"):
        storage.write_trajectories("../x", 1, groups)
    assert all_files(path.parent) == ["0007.jsonl"]


def test_json_files(storage: ModelStorage) -> None:
    storage.write_json("model.json", {"base_model": "tiny-random", "lora_rank": 8})
    assert storage.read_json("model.json") == {"base_model": "tiny-random", "lora_rank": 8}
    for bad in ("../escape.json", "/abs.json", ""):
        with pytest.raises(ValueError, match="inside the model folder"):
            storage.write_json(bad, {})


def test_checkpoint_writes_keep_no_python_memory_per_step(storage: ModelStorage) -> None:
    """A long run writes a checkpoint a step: nothing of each may stay behind in the process (the
    leftover sweep once globbed a new pattern a step, ~0.75 KB of compiled-pattern caches each)."""

    def write(folder: Path) -> None:
        (folder / "state.bin").write_bytes(b"x")

    def run(steps: range) -> None:
        for step in steps:
            storage.write_checkpoint(step, write)
            storage.delete_checkpoints([step])

    run(range(1, 21))  # warm-up: first-call caches
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run(range(21, 221))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"200 checkpoint writes kept {grown} bytes of Python memory"
