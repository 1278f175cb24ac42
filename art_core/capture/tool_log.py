"""Tool calls written into a trajectory's logs, one line each: `mcp tool call {json}`.

The MCP door (`integrations.mcp`) writes them; exporters (the Langfuse sink) read them back. The
JSON holds `name`, `arguments`, `result` (None when the call failed), `error` and `seconds`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TOOL_LOG_PREFIX = "mcp tool call "
"""Prefix of a tool call's log line; the rest is the call as JSON."""


def tool_calls_from_logs(logs: Sequence[str]) -> list[dict[str, Any]]:
    """The tool calls recorded in `logs`, in order (lines that are not tool calls are skipped)."""
    return [json.loads(line[len(TOOL_LOG_PREFIX) :]) for line in logs if line.startswith(TOOL_LOG_PREFIX)]
