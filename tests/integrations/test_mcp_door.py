"""The MCP door (integrations/mcp.py): tool calls of a wrapped `mcp.Client` recorded into the trajectory,
against our real server (tiny model) and real MCP servers started as subprocesses."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from art_core.model import TrainableModel
from integrations import rollout
from integrations.mcp import record_tool_calls, recorded_tool_calls, tool_calls_from_logs
from mcp_rl.connection import ServerConnection
from tests.helpers_mcp import EXAMPLE_SERVER, fault_spec
from tests.helpers_serving import served_fixture

ASYNC = pytest.mark.asyncio(loop_scope="module")
served = served_fixture("mcp_door", project="mcp-door-tests", name="door")


async def _say(model: TrainableModel, text: str) -> None:
    await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=2
    )


@ASYNC
async def test_door_records_calls_errors_and_latency_into_the_trajectory(model: TrainableModel) -> None:
    params = StdioServerParameters(command=sys.executable, args=[str(EXAMPLE_SERVER)])
    async with Client(params, cache=None) as raw:
        client = record_tool_calls(raw)
        assert record_tool_calls(client) is client
        outside = await client.call_tool("stock_level", {"product": "apples"})  # no scope: not recorded
        async with rollout(model) as scope:
            await _say(model, "check the stock")
            ok = await client.call_tool("stock_level", {"product": "figs"})
            bad = await client.call_tool("ship_order", {"product": "figs", "units": 50})
            calls = recorded_tool_calls(scope)
        assert outside.content[0].text == "12" and ok.content[0].text == "4" and bad.is_error
    trajectory = scope.trajectory
    assert [(c.name, c.arguments, c.result, c.failed) for c in calls] == [
        ("stock_level", {"product": "figs"}, "4", False),
        ("ship_order", {"product": "figs", "units": 50}, None, True),
    ]
    assert calls[1].error is not None and "cannot ship 50 figs" in calls[1].error
    assert all(c.seconds > 0 for c in calls)
    assert tool_calls_from_logs(trajectory.logs)[0].result == "4"
    m = trajectory.metrics
    assert (m["tool_calls"], m["tool_errors"], m["tool_calls/stock_level"], m["tool_errors/ship_order"]) == (
        2,
        1,
        1,
        1,
    )
    assert m["tool_seconds/stock_level"] > 0 and len(trajectory.turns) == 1


@ASYNC
async def test_door_records_an_exception_and_raises_it(model: TrainableModel) -> None:
    connection = await ServerConnection(fault_spec()).start()
    try:
        async with rollout(model) as scope:
            await _say(model, "go")
            with pytest.raises(Exception, match="Connection closed"):
                await connection.client.call_tool("crash", {})
    finally:
        await connection.close()
    (call,) = tool_calls_from_logs(scope.trajectory.logs)
    assert (
        call.name == "crash" and call.result is None and call.error is not None and "MCPError" in call.error
    )
    assert scope.trajectory.metrics["tool_errors/crash"] == 1


@ASYNC
async def test_concurrent_rollouts_on_one_client_never_mix(model: TrainableModel) -> None:
    connection = await ServerConnection(fault_spec()).start()

    async def one(text: str) -> Any:
        async with rollout(model) as scope:
            await _say(model, text)
            await connection.client.call_tool("echo", {"text": text})
        return scope.trajectory

    try:
        a, b = await asyncio.gather(one("alpha"), one("beta"))
    finally:
        await connection.close()
    assert [c.result for c in tool_calls_from_logs(a.logs)] == ["alpha"]
    assert [c.result for c in tool_calls_from_logs(b.logs)] == ["beta"]
