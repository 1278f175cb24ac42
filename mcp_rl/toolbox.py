"""Safe tool calls: whatever a tool or its server does, the run goes on.

`call_tool` turns every outcome of one call into either a tool message for the model or a
`ServerFailure` that ends only the current rollout:

| what happened                                  | the model sees                         | counted as       |
|------------------------------------------------|----------------------------------------|------------------|
| a result                                       | its text, cut at `max_output_chars`    | -                |
|                                                | with a visible truncation marker       | `truncated`      |
| a result with `is_error`, or an MCP error      | `Error: ...`                           | `tool_error`     |
| a tool the server does not have                | `Error: unknown tool ...` (not sent)   | `unknown_tool`   |
| arguments that are not a JSON object           | `Error: ...` (not sent)                | `bad_arguments`  |
| no answer within `timeout_s`, server answers   | `Error: ... timed out ...`             | `timeout`        |
|   a ping                                       |                                        |                  |
| no answer and no ping either (a hung server)   | - (the rollout fails)                  | `ServerFailure`  |
| the connection closed (a crashed server), or a | - (the rollout fails)                  | `ServerFailure`  |
|   transport error                              |                                        |                  |
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT
from pydantic import ValidationError

from integrations.mcp import ToolCallRecord, record, result_text
from integrations.scope import current_scope
from mcp_rl.connection import ServerConnection, describe_exception

OutcomeKind = Literal["ok", "truncated", "tool_error", "unknown_tool", "bad_arguments", "timeout"]


@dataclass(frozen=True)
class ToolCallConfig:
    """Limits on every tool call."""

    timeout_s: float = 30.0
    """Seconds a call may take (`--tool-timeout`); then the server is pinged to tell slow from hung."""
    max_output_chars: int = 4000
    """Characters of a result the model sees (`--max-tool-output`); the rest is replaced by a marker."""
    ping_timeout_s: float = 5.0
    """Seconds a hung-or-slow server has to answer a ping after a timed-out call."""

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"--tool-timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.max_output_chars < 100:
            raise ValueError(
                f"--max-tool-output must be at least 100 characters, got {self.max_output_chars}"
            )
        if not self.ping_timeout_s > 0:
            raise ValueError(f"ping_timeout_s must be > 0, got {self.ping_timeout_s}")


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gives the model (`content`, the tool message) and how it went."""

    content: str
    kind: OutcomeKind

    @property
    def is_error(self) -> bool:
        return self.kind not in ("ok", "truncated")


class ServerFailure(RuntimeError):
    """The server crashed or hung during a call: the rollout fails, the server is replaced."""

    def __init__(self, reason: str, *, hung: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hung = hung


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to at most `limit` characters, ending in a marker saying how much was cut."""
    if len(text) <= limit:
        return text, False
    marker = f"\n[... truncated by mcp-rl: {len(text):,} characters in all, only the first {{kept:,}} shown]"
    kept = max(0, limit - len(marker.format(kept=limit)))
    return text[:kept] + marker.format(kept=kept), True


def _note(name: str, arguments: dict[str, Any], error: str) -> None:
    """Record a call that never reached the server (unknown tool, bad arguments) in the rollout."""
    scope = current_scope()
    if scope is not None:
        record(scope, ToolCallRecord(name, arguments, None, error, 0.0))


def parse_arguments(raw: Any) -> dict[str, Any] | str:
    """The model's tool-call arguments as a dict, or the reason they are not a JSON object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        return f"the arguments are not valid JSON ({exc.msg})"
    return (
        value
        if isinstance(value, dict)
        else f"the arguments must be a JSON object, got {type(value).__name__}"
    )


async def call_tool(
    connection: ServerConnection,
    known_tools: set[str],
    name: str,
    raw_arguments: Any,
    config: ToolCallConfig,
) -> ToolOutcome:
    """Call one tool safely; see the module docstring. Raises only `ServerFailure`."""
    arguments = parse_arguments(raw_arguments)
    if isinstance(arguments, str):
        _note(name, {}, arguments)
        return ToolOutcome(
            f"Error: {arguments}. Call {name} again with a JSON object of arguments.", "bad_arguments"
        )
    if name not in known_tools:
        error = f"unknown tool {name!r}"
        _note(name, arguments, error)
        return ToolOutcome(
            f"Error: {error}. Available tools: {', '.join(sorted(known_tools))}.", "unknown_tool"
        )
    started = time.perf_counter()
    try:
        # The SDK's own timeout answers first; the outer one only guards a transport that ignores it.
        result = await asyncio.wait_for(
            connection.client.call_tool(name, arguments, read_timeout_seconds=config.timeout_s),
            config.timeout_s + config.ping_timeout_s + 5.0,
        )
    except MCPError as exc:
        if exc.code == CONNECTION_CLOSED:
            raise ServerFailure(
                f"the server closed the connection during {name} (crashed?): {exc}", hung=False
            ) from exc
        if exc.code == REQUEST_TIMEOUT:
            return await _timed_out(connection, name, config, time.perf_counter() - started)
        return ToolOutcome(f"Error: {exc}", "tool_error")
    except TimeoutError:
        return await _timed_out(connection, name, config, time.perf_counter() - started)
    except ValidationError as exc:
        return ToolOutcome(
            f"Error: the server sent a malformed result: {describe_exception(exc)[:500]}", "tool_error"
        )
    except Exception as exc:
        raise ServerFailure(f"transport error during {name}: {describe_exception(exc)}", hung=False) from exc
    text = result_text(result)
    if getattr(result, "is_error", False):
        text, _ = truncate(text, config.max_output_chars)
        return ToolOutcome(f"Error: {text}", "tool_error")
    text, cut = truncate(text, config.max_output_chars)
    return ToolOutcome(text, "truncated" if cut else "ok")


async def _timed_out(
    connection: ServerConnection, name: str, config: ToolCallConfig, seconds: float
) -> ToolOutcome:
    if await connection.ping(config.ping_timeout_s):
        return ToolOutcome(
            f"Error: {name} timed out after {config.timeout_s:g} s (the server is still up; try something else).",
            "timeout",
        )
    raise ServerFailure(
        f"{name} timed out after {seconds:.1f} s and the server did not answer a ping within "
        f"{config.ping_timeout_s:g} s (hung)",
        hung=True,
    )


__all__ = [
    "OutcomeKind",
    "ServerFailure",
    "ToolCallConfig",
    "ToolOutcome",
    "call_tool",
    "parse_arguments",
    "truncate",
]
