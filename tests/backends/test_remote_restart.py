"""`art serve` SIGKILLed in the middle of a train step and started again on the same port and folder:
`RemoteBackend.train` resends the request with its idempotency key, and no step is applied twice
(issue 18). Killed before the step committed, the retry trains it; killed after, the retry gets
the committed step's result back. Without retries, the error says what to check.

The server kills itself at the exact point (tests/backends/serve_dies.py): a kill sent from the
client's progress callback races the server, which may already have committed the step, or sent
its result, by the time the signal lands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from art_core.app import free_port, wait_healthy
from art_core.backends.remote import RemoteBackend, RemoteUnavailableError
from art_core.model import TrainableModel
from art_core.storage import ModelStorage
from art_core.training.config import TrainConfig
from tests.backends.test_remote import KEY, STARTUP_TIMEOUT_S, _server_env, sampled_groups


class Serve:
    """One `art serve` command, started (and restarted) on a fixed port and folder."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.die = ""
        """`ART_TEST_DIE` of the next start: `<point>:<marker>` (serve_dies.py), "" for none."""

    def start(self) -> None:
        self.starts += 1
        log = self.folder / f"server-{self.starts}.log"
        command = [
            sys.executable,
            str(Path(__file__).with_name("serve_dies.py")),
            "serve",
            "--port",
            str(self.port),
            "--api-key",
            KEY,
        ]
        command += ["--path", str(self.folder / ".art"), "--log-level", "warning"]
        with log.open("wb") as sink:
            env = {**_server_env(), "ART_TEST_DIE": self.die, "PYTHONPATH": str(Path(__file__).parents[2])}
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        self.log = log

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def restart_when_it_dies(self) -> threading.Thread:
        """A thread that starts the server again (without a death point) once it has died."""
        process = self.process
        assert process is not None

        def watch() -> None:
            process.wait()
            self.die = ""
            self.start()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


async def test_server_killed_mid_step_is_retried_and_no_step_is_applied_twice(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    serve.start()
    try:
        assert serve.process is not None
        wait_healthy(serve.url, serve.process, serve.log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
        model = TrainableModel(project="remote", name="agent-restart", base_model="tiny-random")
        backend = RemoteBackend(serve.url, api_key=KEY, retry_wait_s=STARTUP_TIMEOUT_S)
        async with backend:
            await model.register(backend)

            def dying_at(point: str) -> threading.Thread:
                serve.die = f"{point}:{tmp_path / point}.died"
                serve.stop()
                serve.start()
                assert serve.process is not None
                wait_healthy(serve.url, serve.process, serve.log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
                return serve.restart_when_it_dies()

            # killed inside the train step, before step 1 committed: the retry trains it
            phases: list[str] = []
            watcher = dying_at("train")
            await model.register(backend)  # the new process has no models yet
            groups = await sampled_groups(model)
            first = await model.train(
                groups, TrainConfig(learning_rate=1e-3), on_progress=lambda p, m: phases.append(p)
            )
            watcher.join(timeout=60)
            assert serve.starts == 3 and (tmp_path / "train.died").exists()
            assert first.step == 1 and first.trained and not first.warnings, first.warnings
            # the retry's phases, after the dead attempt's "prepare" when it reached the client in time
            assert phases[-4:] == ["prepare", "train", "checkpoint", "done"] and phases[:-4] in (
                [],
                ["prepare"],
            )

            # killed right after step 2 committed, before any answer: the retry gets step 2 back
            phases = []
            watcher = dying_at("commit")
            await model.register(backend)  # the new process has no models yet
            groups = await sampled_groups(model)
            second = await model.train(
                groups, TrainConfig(learning_rate=1e-3), on_progress=lambda p, m: phases.append(p)
            )
            watcher.join(timeout=60)
            assert serve.starts == 5 and (tmp_path / "commit.died").exists()
            assert second.step == 2 and second.trained
            assert "already applied as step 2" in second.warnings[0]
            assert second.metrics["step"] == 2.0 and second.metrics["loss/train"] == pytest.approx(
                second.metrics["loss/loss"]
            )
            assert phases in (["prepare", "train"], ["prepare"], [])  # as far as the dead attempt's lines got
            assert await model.get_step() == 2
            assert await model.list_checkpoints() == [0, 1, 2]
            history = await model.history()
            assert [h["step"] for h in history if "trained" in h] == [1, 2]
        storage = ModelStorage.create(tmp_path / ".art", "remote", "agent-restart")
        assert len(storage.history_path.read_text().splitlines()) == 2

        # no retries: a clear error that says the step may have been applied
        serve.kill()
        async with RemoteBackend(serve.url, api_key=KEY, train_retries=0) as gone:
            with pytest.raises(RemoteUnavailableError, match="gave up after 0 retries.*get_step"):
                await gone.train(model.name, groups, TrainConfig(learning_rate=1e-3))
    finally:
        serve.stop()
