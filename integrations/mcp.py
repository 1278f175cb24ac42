"""The MCP door: tool calls made through an `mcp.Client` inside a rollout scope join its trajectory.

```python
from mcp import Client
from integrations import rollout
from integrations.mcp import record_tool_calls, recorded_tool_calls

async with rollout(model) as scope, Client(params) as raw:
    client = record_tool_calls(raw)                   # same API as the client it wraps
    result = await client.call_tool("add", {"a": 1, "b": 2})
    ...                                               # LLM calls through model.openai_client()
trajectory = scope.trajectory
```

Each `call_tool` made while a rollout scope is active is recorded into that scope (the contextvar,
so concurrent rollouts sharing one wrapped client never mix): a `ToolCallRecord` with the name,
the arguments, the result text or the error, and the latency. The scope's trajectory then has
- one line per call in `logs` (`mcp tool call {json}`, result text cut at `log_chars`);
- per-tool counts in `metrics`: `tool_calls`, `tool_errors`, `tool_calls/<name>`,
  `tool_errors/<name>` and `tool_seconds/<name>` (total latency).

An error is a result with `is_error` set, or an exception raised by the call (an unknown tool on a
2.x server, a timeout, a closed connection); exceptions are recorded, then raised unchanged.
Calls outside any scope pass through unrecorded. The tool messages themselves are the agent's to
send: they reach the trajectory as the messages of its next LLM call (`mcp_rl` appends the last
ones itself).

`langchain-mcp-adapters` is not supported: its release that installs beside mcp 2.x (0.3.1)
imports `mcp.server.fastmcp`, which mcp 2.x removed, and 0.3.2 requires `mcp<2`.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from art_core.capture import TOOL_LOG_PREFIX
from integrations.scope import RolloutScope, current_scope

LOG_PREFIX = TOOL_LOG_PREFIX
"""Prefix of the trajectory log line of each recorded call (the rest is the record as JSON)."""


@dataclass(frozen=True)
class ToolCallRecord:
    """One MCP tool call made inside a rollout scope."""

    name: str
    """The tool's name as called."""
    arguments: dict[str, Any]
    """The arguments sent."""
    result: str | None
    """The result's text content (joined), or None when the call raised."""
    error: str | None
    """The error: the result's text when `is_error` was set, or `"<ExceptionType>: message"`."""
    seconds: float
    """Wall-clock latency of the call."""

    @property
    def failed(self) -> bool:
        return self.error is not None

    def log_line(self, log_chars: int) -> str:
        """The trajectory's log line for this call, result and error cut at `log_chars` characters."""
        data = asdict(self)
        for key in ("result", "error"):
            text = data[key]
            if isinstance(text, str) and len(text) > log_chars:
                data[key] = f"{text[:log_chars]}... [{len(text) - log_chars} more characters]"
        return LOG_PREFIX + json.dumps(data, ensure_ascii=False, default=str)


def result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text contents joined by newlines; other blocks as JSON.

    Structured content is used when there is no content block at all.
    """
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        elif hasattr(block, "model_dump"):
            dumped = block.model_dump(mode="json", exclude_none=True, by_alias=True)
            if isinstance(dumped.get("data"), str) and len(dumped["data"]) > 64:
                dumped["data"] = f"<{len(dumped['data'])} base64 characters>"
            parts.append(json.dumps(dumped, ensure_ascii=False))
        else:
            parts.append(str(block))
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    return "\n".join(parts)


_RECORDS: weakref.WeakKeyDictionary[RolloutScope, list[ToolCallRecord]] = weakref.WeakKeyDictionary()


def recorded_tool_calls(scope: RolloutScope) -> list[ToolCallRecord]:
    """The tool calls recorded into `scope` so far, in the order they finished."""
    return list(_RECORDS.get(scope, ()))


def record(scope: RolloutScope, call: ToolCallRecord, *, log_chars: int = 2000) -> None:
    """Add a finished call to `scope`: its record, its log line and the per-tool metrics."""
    _RECORDS.setdefault(scope, []).append(call)
    scope.logs.append(call.log_line(log_chars))
    metrics = scope.metrics
    error = int(call.failed)
    metrics["tool_calls"] = int(metrics.get("tool_calls", 0)) + 1
    metrics["tool_errors"] = int(metrics.get("tool_errors", 0)) + error
    metrics[f"tool_calls/{call.name}"] = int(metrics.get(f"tool_calls/{call.name}", 0)) + 1
    metrics[f"tool_errors/{call.name}"] = int(metrics.get(f"tool_errors/{call.name}", 0)) + error
    seconds = float(metrics.get(f"tool_seconds/{call.name}", 0.0)) + call.seconds
    metrics[f"tool_seconds/{call.name}"] = round(seconds, 6)


class RecordingClient:
    """An `mcp.Client` whose `call_tool` is recorded into the active rollout scope.

    Every other attribute is the wrapped client's. Enter the wrapped client yourself, or enter this
    wrapper (`async with record_tool_calls(Client(...)) as client:`), which enters the client.
    """

    def __init__(self, client: Any, *, log_chars: int = 2000) -> None:
        if not callable(getattr(client, "call_tool", None)):
            raise TypeError(
                f"expected an mcp.Client (or ClientSession), got {type(client).__name__}: it has no call_tool"
            )
        if log_chars < 1:
            raise ValueError(f"log_chars must be >= 1, got {log_chars}")
        self.client = client
        self.log_chars = log_chars

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def __aenter__(self) -> RecordingClient:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.client.__aexit__(*exc_info)

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """`client.call_tool(...)`, recorded into the active rollout scope (if any)."""
        scope = current_scope()
        started = time.perf_counter()
        try:
            result = await self.client.call_tool(name, arguments, *args, **kwargs)
        except BaseException as exc:
            if scope is not None:
                error = f"{type(exc).__name__}: {exc}"
                record(
                    scope,
                    ToolCallRecord(name, dict(arguments or {}), None, error, _since(started)),
                    log_chars=self.log_chars,
                )
            raise
        if scope is not None:
            text = result_text(result)
            failed = bool(getattr(result, "is_error", False))
            call = ToolCallRecord(
                name,
                dict(arguments or {}),
                None if failed else text,
                text if failed else None,
                _since(started),
            )
            record(scope, call, log_chars=self.log_chars)
        return result


def _since(started: float) -> float:
    return time.perf_counter() - started


def record_tool_calls(client: Any, *, log_chars: int = 2000) -> RecordingClient:
    """Wrap an `mcp.Client` so its tool calls inside rollout scopes join their trajectories (idempotent)."""
    if isinstance(client, RecordingClient):
        return client
    return RecordingClient(client, log_chars=log_chars)


def tool_calls_from_logs(logs: list[str]) -> list[ToolCallRecord]:
    """The tool-call records written into a trajectory's logs (results as cut for the log)."""
    found = []
    for line in logs:
        if line.startswith(LOG_PREFIX):
            found.append(ToolCallRecord(**json.loads(line[len(LOG_PREFIX) :])))
    return found


__all__ = [
    "LOG_PREFIX",
    "RecordingClient",
    "ToolCallRecord",
    "record",
    "record_tool_calls",
    "recorded_tool_calls",
    "result_text",
    "tool_calls_from_logs",
]
