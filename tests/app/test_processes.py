"""`art_core.app.processes`: free ports, waiting for a server, stopping a whole process group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_core.app import ServerStartError, free_port, stop_group, wait_healthy

# A leader that starts a child which ignores SIGINT and SIGTERM, prints the child's pid, then waits.
LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_stop_group_ends_the_leader_and_the_children_that_outlive_it() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    stop_group(leader, grace=((2, 10.0),))  # SIGINT ends the leader; the child ignores it
    assert leader.returncode is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_wait_healthy_fails_at_once_with_the_log_when_the_process_exits(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("boom: the port is taken\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"exited with 3:\nboom"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", process, log, api_key=None, timeout_s=60)
    assert time.monotonic() - started < 10
