"""Which MCP server to reach and how: a stdio command or a streamable-HTTP URL (`ServerSpec`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlparse

Isolation = Literal["per-rollout", "shared"]
ISOLATIONS: tuple[Isolation, ...] = ("per-rollout", "shared")

WORKDIR_PLACEHOLDER = "{workdir}"
"""Written in a stdio command's arguments, it becomes the rollout's own copy of `workdir`."""


class ServerSpecError(ValueError):
    """A server given in a way that cannot work (no command and no URL, a bad --env, ...)."""


@dataclass(frozen=True)
class ServerSpec:
    """An MCP server: `command` (+ `args`) over stdio, or `url` over streamable HTTP."""

    command: str | None = None
    """The executable of a stdio server (e.g. `mcp-server-time`); None with `url`."""
    args: tuple[str, ...] = ()
    """Its arguments; `{workdir}` in one is replaced by the working directory of the process."""
    env: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Environment of a stdio server beyond the few variables the SDK passes on (HOME, PATH, ...)."""
    url: str | None = None
    """The streamable-HTTP endpoint (e.g. `http://127.0.0.1:8000/mcp`); None with `command`."""
    headers: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """HTTP headers sent with every request to `url` (e.g. `Authorization: Bearer ...`)."""
    workdir: Path | None = None
    """A folder copied to each server process as its working directory (stdio only)."""
    mode: Literal["auto", "legacy"] = "auto"
    """Protocol negotiation: "auto" probes the 2026 `server/discover` and falls back to the
    `initialize` handshake; "legacy" goes straight to `initialize` (quieter against 1.x servers)."""

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ServerSpecError("give exactly one of a stdio command (--server) and a URL (--url)")
        if self.command is not None and not self.command.strip():
            raise ServerSpecError(
                "the --server command is empty; e.g. --server 'mcp-server-time --local-timezone UTC'"
            )
        if self.url is not None:
            parsed = urlparse(self.url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ServerSpecError(
                    f"--url must be an http(s) URL such as http://127.0.0.1:8000/mcp, got {self.url!r}"
                )
            if self.env:
                raise ServerSpecError(
                    "--env applies to stdio servers (--server) only; a URL server has its own"
                )
            if self.workdir is not None:
                raise ServerSpecError("--workdir applies to stdio servers (--server) only")
        if self.command is not None and self.headers:
            raise ServerSpecError("--header applies to URL servers (--url) only")
        if self.workdir is not None and not Path(self.workdir).is_dir():
            raise ServerSpecError(f"--workdir {self.workdir} is not a folder")
        if self.mode not in ("auto", "legacy"):
            raise ServerSpecError(f"mode must be 'auto' or 'legacy', got {self.mode!r}")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))

    @property
    def is_stdio(self) -> bool:
        return self.command is not None

    def describe(self) -> str:
        """A short human-readable name: the command line or the URL (no header values, no env)."""
        if self.url is not None:
            return self.url
        return shlex.join([str(self.command), *self.args])


def parse_pairs(items: list[str] | tuple[str, ...], *, what: str, sep: str) -> dict[str, str]:
    """`["K=V", ...]` (or `"K: V"` with sep=":") as a dict; a clear error for a malformed item."""
    pairs: dict[str, str] = {}
    for item in items:
        key, found, value = item.partition(sep)
        key = key.strip()
        if not found or not key:
            raise ServerSpecError(f"{what} {item!r} must look like KEY{sep}VALUE")
        pairs[key] = value.strip() if sep == ":" else value
    return pairs


def spec_from_cli(
    *,
    server: str | None,
    url: str | None,
    env: list[str] | tuple[str, ...] = (),
    headers: list[str] | tuple[str, ...] = (),
    workdir: Path | None = None,
    mode: Literal["auto", "legacy"] = "auto",
) -> ServerSpec:
    """The ServerSpec of `--server "CMD ARGS"` / `--url URL` with `--env K=V`, `--header "K: V"`."""
    command: str | None = None
    args: tuple[str, ...] = ()
    if server is not None:
        try:
            words = shlex.split(server)
        except ValueError as exc:
            raise ServerSpecError(f"cannot split --server {server!r} into words: {exc}") from exc
        if not words:
            raise ServerSpecError("the --server command is empty")
        command, args = words[0], tuple(words[1:])
    return ServerSpec(
        command=command,
        args=args,
        env=MappingProxyType(parse_pairs(env, what="--env", sep="=")),
        url=url,
        headers=MappingProxyType(parse_pairs(headers, what="--header", sep=":")),
        workdir=workdir,
        mode=mode,
    )


__all__ = [
    "ISOLATIONS",
    "WORKDIR_PLACEHOLDER",
    "Isolation",
    "ServerSpec",
    "ServerSpecError",
    "parse_pairs",
    "spec_from_cli",
]
