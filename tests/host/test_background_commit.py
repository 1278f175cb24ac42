"""The background commit of the torch path (issue 19 item 2; `host.commits`): `train` returns before
its step's commit finished, the next call that needs the disk waits for it, a failed commit is
raised (typed, rolled back) by the next train or close, and history.jsonl has one line per step.

The model is the real tiny one in a real `ModelService` writing to a real folder; the storage is the
real `ModelStorage` with one fault put in its commit: it holds the write until the test opens a gate
(a slow disk), or its checkpoint write meets ENOSPC, which the real `commit_step` turns into a
`StorageFullError` and cleans up after (tests/host/test_faults.py fills a real tmpfs instead).
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from art_core.host.records import ModelSpec
from art_core.host.service import ModelService
from art_core.host.serving import TorchServing
from art_core.rollouts.groups import TrajectoryGroup
from art_core.storage import ModelStorage, StorageFullError
from tests.host.test_exact_resume import CONFIG, groups

SPEC = ModelSpec(name="overlap", project="commits", base_model="tiny-random")
GATE_S = 1.0


@dataclass(frozen=True)
class FaultyStorage(ModelStorage):
    """`ModelStorage` whose `commit_step` of step `at` waits for `gate` first, and whose checkpoint
    write of each step in `fail_once` fails with ENOSPC (once) after the trajectories are written."""

    at: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    fail_once: list[int] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)

    def commit_step(  # type: ignore[override]
        self,
        step: int,
        groups: Sequence[TrajectoryGroup],
        save_state: Callable[[Path], None],
        *args: object,
        **kwargs: object,
    ) -> Path:
        if step == self.at:
            self.entered.set()
            self.gate.wait(60)
        if step in self.fail_once:
            self.fail_once.remove(step)

            def save_state(folder: Path) -> None:
                raise OSError(errno.ENOSPC, "No space left on device", str(folder))

        return super().commit_step(step, groups, save_state, *args, **kwargs)  # type: ignore[arg-type]


def _service(base: Path, storage: dict[str, object], serving: TorchServing | None = None) -> ModelService:
    service = ModelService(base, serving)
    hosted = service.register(SPEC)
    hosted.storage = FaultyStorage(hosted.storage.root, **storage)  # type: ignore[arg-type]
    return service


def _train_lines(storage: ModelStorage) -> list[int]:
    return [int(h["step"]) for h in storage.read_history() if "trained" in h]


async def test_train_returns_before_a_slow_commit_and_the_next_train_waits_for_it(tmp_path: Path) -> None:
    service = _service(tmp_path, {"at": 1})
    hosted = service.get(SPEC.name)
    storage = hosted.storage
    assert isinstance(storage, FaultyStorage)
    try:
        first = await service.train(SPEC.name, groups(1), CONFIG)
        assert first.step == 1 and first.trained and hosted.step == 1  # the new step serves
        assert "time/checkpoint_s" not in first.metrics  # still being written
        assert storage.entered.wait(30)
        assert storage.steps() == [0] and _train_lines(storage) == []  # nothing of step 1 on disk yet

        second = asyncio.create_task(service.train(SPEC.name, groups(2), CONFIG))
        step_read = asyncio.create_task(asyncio.to_thread(lambda: service.committed(SPEC.name).step))
        await asyncio.sleep(GATE_S)
        assert not second.done() and not step_read.done()  # both wait for step 1's commit
        storage.gate.set()
        result = await second
        assert result.step == 2 and await step_read == 1
        assert result.metrics["time/checkpoint_wait_s"] >= GATE_S * 0.9
    finally:
        storage.gate.set()
        service.close()
    lines = storage.read_history()
    assert [int(h["step"]) for h in lines] == [1, 2] and storage.steps() == [0, 1, 2]  # complete after close
    assert all(h["time/checkpoint_s"] > 0 for h in lines)
    assert lines[0]["time/checkpoint_s"] >= GATE_S * 0.9 and "time/checkpoint_wait_s" in lines[1]
    assert not list(storage.root.rglob(".tmp-*"))


async def test_a_failed_background_commit_is_raised_by_the_next_train_after_the_rollback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = _service(tmp_path, {"fail_once": [2]})
    hosted = service.get(SPEC.name)
    storage = hosted.storage
    try:
        await service.train(SPEC.name, groups(1), CONFIG)
        second = await service.train(SPEC.name, groups(2), CONFIG)
        assert second.step == 2  # returned before its commit failed
        assert service.committed(SPEC.name).step == 1  # a read waits, and does not take the error
        assert "background commit of step 2 of overlap failed (StorageFullError" in caplog.text  # at once
        with pytest.raises(StorageFullError, match="step 2 was not committed.*checkpoint 1 is intact"):
            await service.train(SPEC.name, groups(2), CONFIG)
        assert hosted.step == 1 and storage.steps() == [0, 1] and _train_lines(storage) == [1]
        assert not list(storage.root.rglob(".tmp-*"))
        assert sorted(p.name for p in (storage.root / "trajectories" / "train").iterdir()) == ["0001.jsonl"]
        hosted.trainer.save_state(tmp_path / "now")  # the trainer is back at checkpoint 1
        for name in ("adapter_model.safetensors", "optimizer.safetensors"):
            now, saved = (
                load_file(str(tmp_path / "now" / name)),
                load_file(str(storage.checkpoint_dir(1) / name)),
            )
            assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in now)

        retried = await service.train(SPEC.name, groups(2), CONFIG)  # raised once: the retry trains
        assert retried.step == 2 and retried.trained
    finally:
        service.close()
    assert _train_lines(storage) == [1, 2] and storage.steps() == [0, 1, 2]


async def test_close_raises_a_failed_background_commit(tmp_path: Path) -> None:
    service = _service(tmp_path, {"fail_once": [1]})
    storage = service.get(SPEC.name).storage
    assert (await service.train(SPEC.name, groups(1), CONFIG)).step == 1
    with pytest.raises(StorageFullError, match="step 1 was not committed"):
        service.close()
    assert storage.steps() == [0] and _train_lines(storage) == []


async def test_overlap_off_commits_before_train_returns(tmp_path: Path) -> None:
    service = _service(tmp_path, {}, TorchServing(overlap_checkpoint=False))
    storage = service.get(SPEC.name).storage
    try:
        result = await service.train(SPEC.name, groups(1), CONFIG)
        assert storage.steps() == [0, 1] and _train_lines(storage) == [1]
        assert result.metrics["time/checkpoint_s"] > 0 and "time/checkpoint_wait_s" not in result.metrics
    finally:
        service.close()
