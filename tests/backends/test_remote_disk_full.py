"""`art serve` whose storage fills during a checkpoint write (issue 18): the client gets a
`RemoteStorageFullError` (507) that says what happened and what to do, the server stays up and
rolled back to the previous checkpoint, nothing half-written is left, and the step trains once
there is room again. The in-process case is tests/host/test_faults.py.

The storage is a small tmpfs, so the test needs root with CAP_SYS_ADMIN (the CI containers have
it); elsewhere it skips and says why. A `ulimit -f` cannot stand in here: the server would hit it
on its log and its model cache before the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from art_core.app import free_port, wait_healthy
from art_core.backends.remote import RemoteBackend, RemoteStorageFullError
from art_core.model import TrainableModel
from art_core.storage import ModelStorage
from art_core.training.config import TrainConfig
from tests.backends.test_remote import KEY, STARTUP_TIMEOUT_S, _server_env, sampled_groups, stop_process
from tests.host.test_faults import TMPFS_SIZE, _mount_tmpfs

LR = TrainConfig(learning_rate=1e-3)


def _fill(folder: Path, leave: int) -> Path:
    """A file that leaves `leave` bytes free on `folder`'s filesystem."""
    stats = os.statvfs(folder)
    filler = folder / "filler"
    with filler.open("wb") as handle:
        handle.write(b"\0" * max(stats.f_bavail * stats.f_frsize - leave, 0))
    return filler


async def test_a_full_disk_under_art_serve_is_a_507_and_the_server_keeps_serving(tmp_path: Path) -> None:
    small = tmp_path / "small"
    if not _mount_tmpfs(small, TMPFS_SIZE):
        pytest.skip(
            "mounting a tmpfs needs root with CAP_SYS_ADMIN (tests/host/test_faults.py covers the rest)"
        )
    port, log = free_port(), tmp_path / "server.log"
    command = [sys.executable, "-m", "art_core.app.cli", "serve", "--port", str(port), "--api-key", KEY]
    command += ["--path", str(small / ".art"), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=_server_env())
    try:
        wait_healthy(url, process, log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
        model = TrainableModel(project="remote", name="disk", base_model="tiny-random")
        async with RemoteBackend(url, api_key=KEY) as backend:
            await model.register(backend)
            first = await model.train(await sampled_groups(model), LR)
            assert first.step == 1 and first.trained
            storage = ModelStorage.create(small / ".art", "remote", "disk")
            checkpoint = storage.checkpoint_dir(1)
            size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
            groups = await sampled_groups(model)
            filler = _fill(small, leave=size // 2)
            try:
                with pytest.raises(RemoteStorageFullError) as caught:
                    await model.train(groups, LR)
            finally:
                filler.unlink()
            error = str(caught.value)
            assert caught.value.status == 507
            assert "No space left on device" in error and "step 2 was not committed" in error
            assert "checkpoint 1 is intact" in error and "Free space" in error
            assert process.poll() is None  # the server is still up
            assert await model.get_step() == 1
            assert await model.list_checkpoints() == [0, 1]
            assert sorted(p.name for p in small.rglob(".tmp-*")) == []
            assert [h["step"] for h in await model.history() if "trained" in h] == [1]
            served = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert served.choices
            again = await model.train(groups, LR)  # room again: the step trains, once
            assert again.step == 2 and again.trained
            assert [h["step"] for h in await model.history() if "trained" in h] == [1, 2]
            assert await model.list_checkpoints() == [0, 1, 2]
    finally:
        stop_process(process, timeout_s=30)
        subprocess.run(["umount", "--lazy", str(small)], check=True)
