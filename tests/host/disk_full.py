"""A checkpoint write that runs out of room, for `tests/host/test_faults.py`; run in-process or as a script.

`python -m tests.host.disk_full ROOT MODE` trains the tiny model one step under ROOT, then takes
the room away and trains a second step (whose background commit fails: the train after it raises),
then gives the room back, loads the run again in a new
backend and trains the step again. It prints one JSON line with what it saw. MODE:
- `fill`: ROOT is a small filesystem (a tmpfs the caller mounted); a filler file leaves less free
  space than a checkpoint needs, so the write fails with ENOSPC;
- `rlimit`: no small filesystem can be made here; RLIMIT_FSIZE is lowered below the size of a
  checkpoint file (SIGXFSZ ignored), so the write fails with EFBIG.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.backends import LocalBackend
from art_core.storage import ModelStorage, StorageFullError

PROJECT, NAME = "faults", "disk"


async def _groups(model: TrainableModel) -> list[TrajectoryGroup]:
    client, groups = model.openai_client(), []
    for g in range(2):
        messages = [{"role": "user", "content": f"Name fruit number {g}."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4, n=3, temperature=1.0
        )
        groups.append(
            TrajectoryGroup(
                Trajectory(messages_and_choices=[*messages, choice], reward=i / 2)
                for i, choice in enumerate(completion.choices)
            )
        )
    return groups


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _take_room(root: Path, checkpoint: Path, mode: str) -> Path | None:
    """Leave less room than a checkpoint needs; returns the filler file (mode `fill`)."""
    if mode == "rlimit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        largest = max(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest // 2, resource.RLIM_INFINITY))
        return None
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    filler = root / "filler"
    with filler.open("wb") as handle:
        handle.write(b"\0" * max(free - _size(checkpoint) // 2, 0))
    return filler


def _give_room_back(filler: Path | None) -> None:
    if filler is None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    else:
        filler.unlink()


async def scenario(root: Path, mode: str) -> dict[str, Any]:
    """Step 1 commits; step 2 finds no room; then the run loads again and step 2 trains."""
    seen: dict[str, Any] = {"mode": mode}
    storage = ModelStorage.create(root, PROJECT, NAME)
    async with LocalBackend(root) as backend:
        model = TrainableModel(project=PROJECT, name=NAME, base_model="tiny-random")
        await model.register(backend)
        first = await model.train(await _groups(model), TrainConfig(learning_rate=1e-2))
        seen["first_step"] = first.step
        groups = await _groups(model)
        filler = _take_room(root, storage.checkpoint_dir(1), mode)
        try:
            # the commit runs in the background (TorchServing.overlap_checkpoint): step 2 returns, and
            # the next train raises its failure (after the rollback) before training anything
            second = await model.train(groups, TrainConfig(learning_rate=1e-2))
            seen["returned_step"] = second.step
            await model.train(groups, TrainConfig(learning_rate=1e-2))
        except StorageFullError as exc:
            seen.update(error_type=type(exc).__name__, error=str(exc), errno=exc.errno)
        finally:
            _give_room_back(filler)
        seen["step_after_error"] = await model.get_step()
        seen["leftovers"] = sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*"))
        seen["checkpoints"] = storage.steps()
        seen["trajectory_files"] = sorted(p.name for p in (storage.root / "trajectories" / "train").iterdir())
        seen["train_lines"] = [h["step"] for h in storage.read_history() if "trained" in h]
        served = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        seen["served_after_error"] = bool(served.choices)
    async with LocalBackend(root) as again:  # the previous checkpoint loads, and the step trains again
        model = TrainableModel(project=PROJECT, name=NAME, base_model="tiny-random")
        await model.register(again)
        seen["step_on_reload"] = await model.get_step()
        retried = await model.train(await _groups(model), TrainConfig(learning_rate=1e-2))
        seen["retried_step"] = retried.step
        seen["train_lines_at_end"] = [h["step"] for h in await model.history() if "trained" in h]  # waits
    return seen


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    root, mode = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(asyncio.run(scenario(root, mode))), flush=True)


if __name__ == "__main__":
    main()
