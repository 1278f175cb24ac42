"""`art serve --train-procs 2` (a real subprocess on 127.0.0.1, tiny model) stopped by a signal: it
shuts down in order and exits 0, its training rank with it, no traceback anywhere, no process left.

The server's stdout and stderr go to one log, which the ranks and replica processes it starts
inherit. The server exits 0 only if its training rank exited 0 (`TrainGroup.close` raises
`TrainWorkerError` otherwise, and `art serve` exits 1: the last test), so a 0 from the server
covers the rank too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from art_core.app import free_port, log_tail, stop_group, wait_healthy
from art_core.app.runs import open_run
from art_core.backends.remote import RemoteBackend
from art_core.model import TrainableModel
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.training.config import TrainConfig

STARTUP_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 120.0
"""How long the server may take to exit after the signal (a step in flight finishes first)."""
GONE_TIMEOUT_S = 15.0
"""How long its child processes may take to be gone once it exited."""
WORKER_MODULE = "art_core.host.train_worker"


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    path: Path


@contextmanager
def serving(folder: Path, *flags: str) -> Iterator[Server]:
    """`art serve --train-procs 2 FLAGS` in a session of its own (so that the process group can be
    signalled as a terminal's Ctrl-C or a supervisor would), killed with its group at the end."""
    port = free_port()
    log = folder / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ART_API_KEY", None)
    command = [sys.executable, "-m", "art_core.app.cli", "serve", "--port", str(port), "--train-procs", "2"]
    command += ["--path", str(folder / ".art"), "--log-level", "warning", *flags]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log, api_key=None, timeout_s=STARTUP_TIMEOUT_S)
        yield Server(url, process, log, folder / ".art")
    finally:
        stop_group(process)


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of process `pid` from /proc (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[0], fields[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid` (by /proc's children lists), with its start time."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            for child in children:
                stat = _stat(child)
                if stat is not None and child not in found:
                    found[child] = stat[1]
                    todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def running(pid: int, started: str) -> bool:
    """Process `pid`, started at `started`, is running (a zombie is not; nor a new process that
    reused the pid)."""
    stat = _stat(pid)
    return stat is not None and stat[1] == started and stat[0] != "Z"


def survivors(processes: dict[int, str]) -> list[int]:
    """The processes of `processes` (pid: start time) still running after GONE_TIMEOUT_S."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while (alive := [pid for pid, started in processes.items() if running(pid, started)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return alive


def ended(server: Server, children: dict[int, str]) -> tuple[int, str]:
    """The server's exit status and its log, once it exited; asserts that no child outlived it."""
    status = server.process.wait(timeout=EXIT_TIMEOUT_S)
    left = survivors(children)
    assert not left, f"left running: {[cmdline(pid) for pid in left]}\n{log_tail(server.log)}"
    return status, server.log.read_text(errors="replace")


def long_groups() -> list[TrajectoryGroup]:
    """Groups of token-level trajectories whose train step takes a few seconds on two CPU ranks."""
    generator = torch.Generator().manual_seed(0)
    result = []
    for _ in range(4):
        prompt = torch.randint(10, 2000, (40,), generator=generator).tolist()
        trajectories = []
        for i in range(8):
            completion = torch.randint(10, 2000, (300,), generator=generator).tolist()
            turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion))
            trajectories.append(Trajectory(turns=[turn], reward=float(i % 2)))
        result.append(TrajectoryGroup(trajectories))
    return result


@pytest.mark.slow
def test_sigterm_stops_serve_and_its_training_rank_with_status_0(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        children = descendants(server.process.pid)
        assert any(WORKER_MODULE in cmdline(pid) for pid in children), children
        server.process.send_signal(signal.SIGTERM)  # to the server alone, as `kill PID` or k8s sends it
        status, log = ended(server, children)
    assert status == 0, log
    assert "Traceback" not in log, log


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_whole_group_mid_step_commits_the_step_and_exits_0(tmp_path: Path, sig: int) -> None:
    """Ctrl-C in a terminal, or a supervisor's SIGTERM to every process (systemd's control-group
    stop), reaches the server, its training rank and its replica process (--fsdp: the sharded
    trainer serves nothing) at once, while a train step runs: the step finishes and commits, the
    client gets its result, then everything exits."""
    with serving(tmp_path, "--fsdp") as server:
        phases: list[str] = []
        children: dict[int, str] = {}

        async def train() -> int:
            model = TrainableModel(project="stop", name="tiny", base_model="tiny-random")
            async with RemoteBackend(server.url, train_retries=0) as backend:
                await model.register(backend)
                names = [cmdline(pid) for pid in descendants(server.process.pid)]
                assert any(WORKER_MODULE in n for n in names) and any("spawn_main" in n for n in names)

                def on_progress(phase: str, metrics: dict[str, float]) -> None:
                    phases.append(phase)
                    if phase == "prepare":  # the step is running (as long as its stream is open)
                        children.update(descendants(server.process.pid))
                        os.killpg(server.process.pid, sig)

                result = await model.train(
                    long_groups(), TrainConfig(learning_rate=1e-3), on_progress=on_progress
                )
                return result.step

        step = asyncio.run(train())
        status, log = ended(server, children)
    assert phases == ["prepare", "train", "checkpoint", "done"]
    assert step == 1
    assert status == 0, log
    assert "Traceback" not in log, log
    storage = open_run(server.path, "stop/tiny")
    assert storage.steps() == [0, 1]
    assert [r["step"] for r in storage.read_history()] == [1]
    assert not list(storage.root.rglob(".tmp-*"))


@pytest.mark.slow
def test_a_training_rank_that_died_is_reported_at_shutdown(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        children = descendants(server.process.pid)
        (worker,) = [pid for pid in children if WORKER_MODULE in cmdline(pid)]
        os.kill(worker, signal.SIGKILL)
        assert not survivors({worker: children[worker]})  # a zombie until the server reaps it
        server.process.send_signal(signal.SIGTERM)
        status, log = ended(server, children)
    assert status == 1, log
    assert f"rank 1 (pid {worker}) exited with status -9" in " ".join(log.split()), log
