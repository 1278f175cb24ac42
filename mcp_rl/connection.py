"""One live MCP session with a server (and, over stdio, the server process): `ServerConnection`.

An `mcp.Client` must be entered and left by the same task (anyio cancel scopes), while the
rollouts that share a server run in tasks of their own. So each connection is owned by a
background task that enters the client, signals that it is ready and waits to be told to close;
any task may call tools through it meanwhile.

Over stdio the server's stderr goes to `log_path` (appended; never the terminal) and, when the
spec has a `workdir`, the process runs in a fresh copy of it (removed on close), which `{workdir}`
in its arguments names. A connection that cannot start raises `ServerStartError` with the last
lines of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TextIO

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

from integrations.mcp import RecordingClient, record_tool_calls
from mcp_rl.server_spec import WORKDIR_PLACEHOLDER, ServerSpec

logger = logging.getLogger(__name__)

LOG_TAIL_CHARS = 2000
"""How much of the server log a start error quotes."""


class ServerStartError(RuntimeError):
    """The MCP server could not be started or did not complete the handshake."""


def flatten_exceptions(exc: BaseException) -> list[BaseException]:
    """The leaf exceptions of (nested) exception groups; `[exc]` for a plain exception."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in flatten_exceptions(inner)]
    return [exc]


def describe_exception(exc: BaseException) -> str:
    """`Type: message` of each leaf of `exc`, joined by "; "."""
    return "; ".join(f"{type(e).__name__}: {e}" for e in flatten_exceptions(exc))


def log_tail(path: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of the server log, or a note that there is none."""
    if path is None or not path.exists():
        return "(no server log)"
    text = path.read_text(errors="replace")
    return text[-chars:].strip() or "(the server wrote nothing to stderr)"


def absolute_args(args: tuple[str, ...]) -> list[str]:
    """Arguments that name an existing relative path made absolute, so they still resolve when the
    process runs in a copied working directory (e.g. `python examples/mcp/server.py`)."""
    return [
        os.path.abspath(a) if not os.path.isabs(a) and os.path.exists(a) and not a.startswith("-") else a
        for a in args
    ]


class ServerConnection:
    """A connected MCP client for one server session; start with `await conn.start()`."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        log_path: Path | None = None,
        start_timeout_s: float = 30.0,
        name: str = "server",
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.name = name
        self.workdir: Path | None = None
        """The process's own copy of `spec.workdir` (stdio with a workdir only)."""
        self._client: RecordingClient | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.broken: str | None = None
        """Why the connection is no longer usable (set by the caller that saw it fail), or None."""

    @property
    def client(self) -> RecordingClient:
        if self._client is None:
            raise RuntimeError(f"{self.name}: not connected; call `await connection.start()` first")
        return self._client

    @property
    def protocol_version(self) -> str | None:
        return self._client.protocol_version if self._client is not None else None

    async def start(self) -> ServerConnection:
        """Launch (stdio) or reach (HTTP) the server and complete the handshake."""
        if self._task is not None:
            raise RuntimeError("a ServerConnection starts only once; make a new one to restart")
        self._task = asyncio.create_task(self._own(), name=f"mcp-{self.name}")
        try:
            await asyncio.wait_for(self._ready.wait(), self.start_timeout_s)
        except TimeoutError:
            await self.close()
            raise ServerStartError(
                self._start_message(f"no handshake within {self.start_timeout_s:.0f} s")
            ) from None
        if self._error is not None:
            error = self._error
            await self.close()
            raise ServerStartError(self._start_message(describe_exception(error))) from error
        return self

    def _start_message(self, reason: str) -> str:
        where = f"; server log {self.log_path}:\n{log_tail(self.log_path)}" if self.spec.is_stdio else ""
        return f"could not connect to MCP server `{self.spec.describe()}`: {reason}{where}"

    async def close(self) -> None:
        """End the session (stops a stdio server: stdin closed, then SIGTERM, then SIGKILL)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10.0)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
            except BaseException as exc:  # the session ended badly (a dead server): nothing left to do
                logger.debug("%s: close: %s", self.name, describe_exception(exc))
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    async def ping(self, timeout_s: float) -> bool:
        """Whether the server answers a ping within `timeout_s` seconds.

        Protocol 2026-07-28 removed `ping`: a server that answers "method not found" is alive too.
        """
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MCPDeprecationWarning)
                await asyncio.wait_for(self.client.send_ping(), timeout_s)
        except MCPError as exc:
            return exc.code not in (CONNECTION_CLOSED, REQUEST_TIMEOUT)
        except Exception:
            return False
        return True

    async def _own(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                target = await self._target(stack)
                client = Client(target, mode=self.spec.mode, cache=None)
                self._client = record_tool_calls(await stack.enter_async_context(client))
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
            else:
                logger.debug("%s: session ended: %s", self.name, describe_exception(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._ready.set()

    async def _target(self, stack: AsyncExitStack) -> Any:
        spec = self.spec
        if spec.url is not None:
            timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's defaults (an SSE stream may stay open)
            http = await stack.enter_async_context(
                httpx2.AsyncClient(headers=dict(spec.headers), timeout=timeout)
            )
            return streamable_http_client(spec.url, http_client=http)
        args = list(spec.args)
        cwd: str | None = None
        if spec.workdir is not None:
            args = absolute_args(spec.args)
            self.workdir = Path(tempfile.mkdtemp(prefix="mcp-rl-workdir-"))
            shutil.copytree(spec.workdir, self.workdir, dirs_exist_ok=True, symlinks=True)
            cwd = str(self.workdir)
            args = [a.replace(WORKDIR_PLACEHOLDER, cwd) for a in args]
        elif any(WORKDIR_PLACEHOLDER in a for a in args):
            raise ValueError(f"the server command uses {WORKDIR_PLACEHOLDER} but no --workdir was given")
        params = StdioServerParameters(command=str(spec.command), args=args, env=dict(spec.env), cwd=cwd)
        errlog = stack.enter_context(self._open_log())
        return stdio_client(params, errlog=errlog)

    def _open_log(self) -> TextIO:
        if self.log_path is None:
            return open(os.devnull, "w")  # noqa: SIM115 - closed by the exit stack
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the exit stack
        log.write(f"--- {self.name}: {self.spec.describe()}\n")
        log.flush()
        return log


async def connect(
    spec: ServerSpec, *, log_path: Path | None = None, name: str = "server", start_timeout_s: float = 30.0
) -> ServerConnection:
    """A started `ServerConnection` (raises `ServerStartError`)."""
    return await ServerConnection(spec, log_path=log_path, name=name, start_timeout_s=start_timeout_s).start()


__all__ = [
    "ServerConnection",
    "ServerStartError",
    "absolute_args",
    "connect",
    "describe_exception",
    "flatten_exceptions",
    "log_tail",
]
