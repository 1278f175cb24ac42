"""mcp_rl: train a model to use the tools of any MCP server (`mcp-rl train`).

Connection (stdio or streamable HTTP, `mcp_rl.connection`), tools as OpenAI schemas
(`mcp_rl.catalog`), safe tool calls (`mcp_rl.toolbox`), per-rollout or shared servers
(`mcp_rl.servers`), the agent loop with `complete_task` (`mcp_rl.agent`), scenarios
(`mcp_rl.scenarios`, `mcp_rl.generation`), rewards (`mcp_rl.rewards`), before/after evaluation
(`mcp_rl.evaluation`) and the pipeline (`mcp_rl.pipeline`). Importing this package is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AgentConfig": "mcp_rl.agent",
    "run_agent": "mcp_rl.agent",
    "COMPLETE_TASK_TOOL": "mcp_rl.catalog",
    "ServerCatalog": "mcp_rl.catalog",
    "read_catalog": "mcp_rl.catalog",
    "ServerConnection": "mcp_rl.connection",
    "ServerStartError": "mcp_rl.connection",
    "RunConfig": "mcp_rl.pipeline",
    "run": "mcp_rl.pipeline",
    "Scenario": "mcp_rl.scenarios",
    "load_scenarios": "mcp_rl.scenarios",
    "save_scenarios": "mcp_rl.scenarios",
    "ServerSpec": "mcp_rl.server_spec",
    "spec_from_cli": "mcp_rl.server_spec",
    "ServerPool": "mcp_rl.servers",
    "ServerFailure": "mcp_rl.toolbox",
    "ToolCallConfig": "mcp_rl.toolbox",
    "call_tool": "mcp_rl.toolbox",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcp_rl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
