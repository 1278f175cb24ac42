"""Child processes of ours: a free port, an `art serve` we wait for, and stopping a process group.

Holds `free_port` (a loopback port nobody listens on), `wait_healthy` (poll `/health` until it
answers, failing at once with the log's tail if the process exits) and `stop_group` (SIGINT, then
SIGTERM, then SIGKILL to the process group of a child started with `start_new_session=True`, and
its children that outlived it). The tests that run `art serve`, `scripts/gpu_check.py` and the
benchmarks share these instead of each writing its own. Standard library and httpx only; nothing
here starts a process (callers use `subprocess.Popen`). Left out: thread and CPU pinning
(benchmark-specific).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


class ServerStartError(RuntimeError):
    """A server process exited, or did not answer `/health`, before the deadline; says why."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0 and read the port back)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(log: Path, chars: int = 4000) -> str:
    """The last `chars` characters of a log file ('' if it does not exist)."""
    try:
        return Path(log).read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def wait_healthy(
    url: str, process: subprocess.Popen[Any], log: Path, *, api_key: str | None, timeout_s: float
) -> None:
    """Return once `GET {url}/health` answers 2xx; raise ServerStartError (with the log's tail) if
    `process` exits first or `timeout_s` passes."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"the server exited with {process.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).is_success:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise ServerStartError(f"the server did not answer {url}/health within {timeout_s} s:\n{log_tail(log)}")


GRACE_S = ((signal.SIGINT, 30.0), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0))
"""The signals `stop_group` sends in turn, each with how long it waits for the leader to exit."""


def stop_group(process: subprocess.Popen[Any], grace: tuple[tuple[int, float], ...] = GRACE_S) -> None:
    """End a child started with `start_new_session=True` and its process group: each signal of
    `grace` in turn until the leader exits, then SIGKILL for children that outlived it."""
    for sig, wait_s in grace:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


__all__ = ["GRACE_S", "ServerStartError", "free_port", "log_tail", "stop_group", "wait_healthy"]
