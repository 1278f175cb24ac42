"""An MCP server (the SDK's MCPServer, stdio or HTTP) whose tools misbehave on purpose, for the fault tests.

python tests/mcp_rl/fault_server.py [--die-at-start] [--slow-start SECONDS] [--http --port P]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("faults", version="1.0.0")
calls = {"n": 0}


@server.tool()
def echo(text: str) -> str:
    """Return the text."""
    return text


@server.tool()
def counter() -> int:
    """Count the calls made to this process (state)."""
    calls["n"] += 1
    return calls["n"]


@server.tool()
def crash() -> str:
    """Kill the server process at once."""
    os._exit(1)


@server.tool()
async def hang() -> str:
    """Block the server's event loop for a long time (the server stops answering anything)."""
    time.sleep(600)
    return "never"


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after `seconds` (the server stays responsive meanwhile)."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def big(chars: int) -> str:
    """A result of `chars` characters."""
    return "x" * chars


@server.tool()
def flood() -> str:
    """A result that, even cut at the default 4000 characters, outgrows the tiny model's 2048-token window."""
    return "x" * 5000


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--die-at-start", action="store_true")
    parser.add_argument("--slow-start", type=float, default=0.0, help="sleep before serving")
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.die_at_start:
        print("fault server: dying at start as asked", file=sys.stderr)
        sys.exit(3)
    time.sleep(args.slow_start)  # a server slow to import its SDK on a busy machine
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()
