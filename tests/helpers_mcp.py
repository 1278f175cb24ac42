"""Real MCP servers as subprocesses for the mcp_rl tests: ours (examples/mcp), the fault server, PyPI ones."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from art_core.app import free_port
from mcp_rl.connection import ServerConnection, ServerStartError
from mcp_rl.server_spec import ServerSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SERVER = ROOT / "examples" / "mcp" / "server.py"
EXAMPLE_SCENARIOS = ROOT / "examples" / "mcp" / "scenarios.jsonl"
FAULT_SERVER = ROOT / "tests" / "mcp_rl" / "fault_server.py"


def example_spec(**kwargs: object) -> ServerSpec:
    return ServerSpec(command=sys.executable, args=(str(EXAMPLE_SERVER),), **kwargs)  # type: ignore[arg-type]


def fault_spec(*args: str) -> ServerSpec:
    return ServerSpec(command=sys.executable, args=(str(FAULT_SERVER), *args))


@contextmanager
def http_server(script: Path, log: Path) -> Iterator[str]:
    """Run `script --http --port P` on 127.0.0.1; yields its MCP URL. Stopped (and reaped) after."""
    port = free_port()
    with log.open("w") as errlog:
        process = subprocess.Popen(
            [sys.executable, str(script), "--http", "--port", str(port)], stdout=errlog, stderr=errlog
        )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def connect_when_up(spec: ServerSpec, *, attempts: int = 60) -> ServerConnection:
    """A started connection, retrying while an HTTP server is still starting."""
    for n in range(attempts):
        try:
            return await ServerConnection(spec, start_timeout_s=10).start()
        except ServerStartError:
            if n == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")
