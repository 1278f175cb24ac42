"""Server processes for rollouts: one per rollout, or one shared by all (`ServerPool`).

Isolation (`--isolation`):
- `per-rollout` (the default): each rollout gets its own session and, over stdio, its own server
  process in its own copy of `--workdir`. Every rollout of a GRPO group then starts from the same
  state, so rewards compare attempts rather than what earlier rollouts changed, and a crash takes
  down one rollout only. It costs a process start (about 0.35 s of CPU on a small box), which is
  small beside a rollout's generation. Over `--url` it is a session per rollout: the server's own
  state is still shared (the pool warns about it).
- `shared`: one connection for every rollout; cheapest, right for stateless servers
  (`mcp-server-time`) and for remote servers that hold state you want shared.

At most `max_starting` servers start at once (by default the number of CPUs, at least 2): a
Python MCP server spends about a second of CPU importing its SDK, so 48 validation rollouts that
each started one at the same moment on a 2-core box took longer than the 30 s handshake timeout,
and 47 of them failed to connect. A start waits for its turn before its timeout begins.

A server that fails a rollout (`ServerFailure`) is replaced: under `shared` the pool restarts it
once (rollouts that were using the dead one fail too, and are counted); under `per-rollout` the
failed process is stopped with its rollout. Either way `stats.restarts` counts the replacements.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from mcp_rl.connection import ServerConnection
from mcp_rl.server_spec import ISOLATIONS, Isolation, ServerSpec

logger = logging.getLogger(__name__)


@dataclass
class PoolStats:
    """What happened to the servers of a run."""

    starts: int = 0
    """Server sessions started."""
    failures: int = 0
    """Servers that crashed or hung under a rollout (each such rollout also has `server_failure`)."""
    hangs: int = 0
    """Of those, the hung ones (a timed-out call and no answer to a ping)."""
    restarts: int = 0
    """Failed servers replaced by a fresh one."""
    start_failures: int = 0
    """Sessions that could not start (their rollouts failed)."""


class ServerPool:
    """Hands out server connections to rollouts: `async with pool.lease(name) as connection:`."""

    def __init__(
        self,
        spec: ServerSpec,
        isolation: Isolation = "per-rollout",
        *,
        log_path: Path | None = None,
        start_timeout_s: float = 30.0,
        max_starting: int | None = None,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"--isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if max_starting is not None and max_starting < 1:
            raise ValueError(f"max_starting must be at least 1, got {max_starting}")
        self.spec = spec
        self.isolation = isolation
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.max_starting = max_starting or max(2, os.cpu_count() or 1)
        """Servers that may be starting at once (module docstring)."""
        self.stats = PoolStats()
        self._starting = asyncio.Semaphore(self.max_starting)
        self._shared: ServerConnection | None = None
        self._lock = asyncio.Lock()
        self._names = itertools.count()
        if isolation == "per-rollout" and not spec.is_stdio:
            logger.warning(
                "--isolation per-rollout over --url opens one session per rollout, but the server's own "
                "state is shared by all sessions"
            )

    async def _start(self, name: str) -> ServerConnection:
        connection = ServerConnection(
            self.spec, log_path=self.log_path, start_timeout_s=self.start_timeout_s, name=name
        )
        try:
            async with self._starting:  # the handshake timeout counts from here
                await connection.start()
        except Exception:
            self.stats.start_failures += 1
            raise
        self.stats.starts += 1
        return connection

    @asynccontextmanager
    async def lease(self, name: str = "rollout") -> AsyncIterator[ServerConnection]:
        """A connection for one rollout (its own, or the shared one); raises ServerStartError."""
        if self.isolation == "per-rollout":
            connection = await self._start(f"{name}-{next(self._names)}")
            try:
                yield connection
            finally:
                await connection.close()
            return
        yield await self._shared_connection()

    async def _shared_connection(self) -> ServerConnection:
        async with self._lock:
            if self._shared is None:
                self._shared = await self._start(f"shared-{next(self._names)}")
            return self._shared

    async def report_failure(self, connection: ServerConnection, reason: str, *, hung: bool) -> None:
        """A rollout's server crashed or hung: count it and replace the server."""
        first = connection.broken is None
        connection.broken = connection.broken or reason
        if not first:
            return
        self.stats.failures += 1
        self.stats.hangs += int(hung)
        self.stats.restarts += 1
        logger.warning("MCP server %s failed (%s); replacing it", connection.name, reason)
        if self.isolation == "shared":
            async with self._lock:
                if self._shared is connection:
                    self._shared = None
            await connection.close()

    async def close(self) -> None:
        """Stop the shared server, if any."""
        async with self._lock:
            shared, self._shared = self._shared, None
        if shared is not None:
            await shared.close()


__all__ = ["PoolStats", "ServerPool"]
