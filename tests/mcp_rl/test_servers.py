"""mcp_rl's connection layer and safe tool calls against real MCP servers started as subprocesses:
ours (examples/mcp) over stdio and HTTP, mcp-server-time, mcp-server-git, and a fault server."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mcp_rl.catalog import COMPLETE_TASK, read_catalog
from mcp_rl.connection import ServerConnection, ServerStartError
from mcp_rl.scenarios import check_answer, load_scenarios
from mcp_rl.server_spec import ServerSpec, ServerSpecError, spec_from_cli
from mcp_rl.servers import ServerPool
from mcp_rl.toolbox import ServerFailure, ToolCallConfig, call_tool, truncate
from tests.helpers_mcp import (
    EXAMPLE_SCENARIOS,
    EXAMPLE_SERVER,
    connect_when_up,
    example_spec,
    fault_spec,
    http_server,
)

FAULT_TOOLS = {"echo", "counter", "crash", "hang", "slow", "big"}
CONFIG = ToolCallConfig(timeout_s=2.0, max_output_chars=1000, ping_timeout_s=2.0)


def singular(plural: str) -> str:
    """ "cherries" -> "cherry", "mangoes" -> "mango", "figs" -> "fig": how the tasks name one unit."""
    if plural.endswith("ies"):
        return plural[:-3] + "y"
    return plural[:-2] if plural.endswith("oes") else plural[:-1]


def warehouse_module() -> Any:
    """examples/mcp/server.py imported afresh (its own stock), to call its tools as functions."""
    spec = importlib.util.spec_from_file_location("warehouse", EXAMPLE_SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_example_server_over_stdio_catalog_and_state(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    connection = await ServerConnection(example_spec(), log_path=log).start()
    try:
        catalog = await read_catalog(connection.client)
        assert catalog.tool_names == [
            "list_products",
            "stock_level",
            "unit_price",
            "receive_delivery",
            "ship_order",
        ]
        stock = catalog.tools[1]["function"]
        products = sorted(warehouse_module().INITIAL_STOCK)
        assert stock["parameters"] == {  # the Literal became an enum: decoding under it names real products
            "type": "object",
            "properties": {"product": {"type": "string", "enum": products}},
            "required": ["product"],
        }
        assert [r.uri for r in catalog.resources] == ["warehouse://policy"]
        assert "fewer than 10 units" in (catalog.resources[0].text or "")
        assert [(p.name, p.arguments) for p in catalog.prompts] == [("restock_review", ["product"])]
        assert catalog.agent_tools()[-1]["function"]["name"] == COMPLETE_TASK
        assert "warehouse://policy" in catalog.describe()
        first = await call_tool(
            connection, set(catalog.tool_names), "receive_delivery", '{"product": "figs", "units": 3}', CONFIG
        )
        second = await call_tool(
            connection, set(catalog.tool_names), "stock_level", {"product": "figs"}, CONFIG
        )
        assert (first.content, first.kind, second.content) == ("7", "ok", "7")  # 4 + 3, state kept
        unlisted = await call_tool(
            connection, set(catalog.tool_names), "stock_level", {"product": "fig"}, CONFIG
        )
        assert unlisted.kind == "tool_error" and "figs" in unlisted.content  # the error lists the names
        error = await call_tool(
            connection, set(catalog.tool_names), "ship_order", {"product": "figs", "units": 99}, CONFIG
        )
        assert error.kind == "tool_error" and "cannot ship 99 figs: 7 in stock" in error.content
    finally:
        await connection.close()
    assert "ship 99 figs: 7 in stock" in " ".join(
        log.read_text().split()
    )  # the server's stderr went to the file


async def test_example_server_over_http_with_a_header(tmp_path: Path) -> None:
    with http_server(EXAMPLE_SERVER, tmp_path / "http.log") as url:
        spec = spec_from_cli(server=None, url=url, headers=["X-Test: yes"])
        assert dict(spec.headers) == {"X-Test": "yes"}
        connection = await connect_when_up(spec)
        try:
            catalog = await read_catalog(connection.client)
            assert "unit_price" in catalog.tool_names and catalog.prompts
            outcome = await call_tool(
                connection, set(catalog.tool_names), "unit_price", {"product": "kiwis"}, CONFIG
            )
            assert outcome.content == "0.75"
        finally:
            await connection.close()


def test_example_scenarios_are_hand_checked_against_the_server() -> None:
    """Every expected answer in examples/mcp/scenarios.jsonl is what the server's tools give."""
    scenarios = load_scenarios(EXAMPLE_SCENARIOS)
    for scenario in scenarios:
        warehouse = warehouse_module()  # fresh state per scenario, as with per-rollout isolation
        words = scenario.task.lower().replace("?", "").replace(".", "").split()
        product = next((p for w in words for p in warehouse.INITIAL_STOCK if w in (p, singular(p))), None)
        assert product is not None, scenario.id
        if "price" in scenario.task or "cost" in scenario.task:
            answer = warehouse.unit_price(product)
        elif "deliver" in scenario.task or "received" in scenario.task:
            answer = warehouse.receive_delivery(product, int(next(w for w in words if w.isdigit())))
        elif "ship" in scenario.task.lower():
            answer = warehouse.ship_order(product, int(next(w for w in words if w.isdigit())))
        else:
            answer = warehouse.stock_level(product)
        assert check_answer(scenario, f"The answer is {answer}.") is True, (scenario.id, answer)
    assert {s.split for s in scenarios} == {"train", "val"}


async def test_mcp_server_time_stateless_shared(tmp_path: Path) -> None:
    if shutil.which("mcp-server-time") is None:
        pytest.skip("mcp-server-time is not installed (pip install mcp-server-time; it is in the dev extra)")
    pool = ServerPool(
        spec_from_cli(server="mcp-server-time --local-timezone UTC", url=None),
        "shared",
        log_path=tmp_path / "log",
    )
    try:
        async with pool.lease() as connection:
            catalog = await read_catalog(connection.client)
            assert {"get_current_time", "convert_time"} <= set(catalog.tool_names)
            arguments = {
                "source_timezone": "America/New_York",
                "time": "14:30",
                "target_timezone": "Europe/Paris",
            }
            outcome = await call_tool(connection, set(catalog.tool_names), "convert_time", arguments, CONFIG)
        async with pool.lease() as again:
            assert again is connection  # shared: one server for all
    finally:
        await pool.close()
    assert outcome.kind == "ok" and "20:30" in outcome.content
    assert pool.stats.starts == 1


async def test_mcp_server_git_per_rollout_workdir_copies(tmp_path: Path) -> None:
    if shutil.which("mcp-server-git") is None or shutil.which("git") is None:
        pytest.skip("needs mcp-server-git (dev extra) and the git binary")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "a.txt").write_text("a\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    spec = spec_from_cli(server="mcp-server-git --repository {workdir}", url=None, workdir=repo)
    pool = ServerPool(spec, "per-rollout", log_path=tmp_path / "git.log")
    async with pool.lease() as first:
        catalog = await read_catalog(first.client)
        assert first.workdir is not None and first.workdir != repo
        known = set(catalog.tool_names)
        made = await call_tool(
            first,
            known,
            "git_create_branch",
            {"repo_path": str(first.workdir), "branch_name": "feature"},
            CONFIG,
        )
        listed = await call_tool(
            first, known, "git_branch", {"repo_path": str(first.workdir), "branch_type": "local"}, CONFIG
        )
        copy = first.workdir
    assert made.kind == "ok" and "feature" in listed.content
    assert not copy.exists()  # the rollout's copy is removed with its server
    async with pool.lease() as second:
        fresh = await call_tool(
            second, known, "git_branch", {"repo_path": str(second.workdir), "branch_type": "local"}, CONFIG
        )
    assert fresh.kind == "ok" and "feature" not in fresh.content  # a fresh copy: no state from rollout 1
    assert "feature" not in subprocess.run([*git[:3], "branch"], capture_output=True, text=True).stdout
    assert pool.stats.starts == 2


# -- faults ---------------------------------------------------------------------------------------


async def test_unknown_tool_and_bad_arguments_are_tool_messages() -> None:
    connection = await ServerConnection(fault_spec()).start()
    try:
        unknown = await call_tool(connection, FAULT_TOOLS, "no_such_tool", {}, CONFIG)
        bad = await call_tool(connection, FAULT_TOOLS, "echo", "{not json", CONFIG)
        wrong_type = await call_tool(connection, FAULT_TOOLS, "echo", "[1]", CONFIG)
        # A name the client believes in but the server lacks reaches the server and comes back as an error.
        missing = await call_tool(connection, {*FAULT_TOOLS, "ghost"}, "ghost", {}, CONFIG)
        still = await call_tool(connection, FAULT_TOOLS, "echo", {"text": "alive"}, CONFIG)
    finally:
        await connection.close()
    assert (
        unknown.kind == "unknown_tool" and "Available tools:" in unknown.content and "echo" in unknown.content
    )
    assert bad.kind == "bad_arguments" and "not valid JSON" in bad.content
    assert wrong_type.kind == "bad_arguments" and "JSON object" in wrong_type.content
    assert missing.is_error and "ghost" in missing.content
    assert still.content == "alive"


async def test_a_two_megabyte_result_is_truncated_with_a_marker() -> None:
    connection = await ServerConnection(fault_spec()).start()
    try:
        outcome = await call_tool(connection, FAULT_TOOLS, "big", {"chars": 2_000_000}, CONFIG)
    finally:
        await connection.close()
    assert outcome.kind == "truncated" and len(outcome.content) <= CONFIG.max_output_chars
    assert "truncated by mcp-rl: 2,000,000 characters in all" in outcome.content
    assert outcome.content.startswith("x" * 500)


def test_truncate_keeps_short_text_and_bounds_long_text() -> None:
    assert truncate("short", 100) == ("short", False)
    text, cut = truncate("y" * 10_000, 300)
    assert cut and len(text) <= 300 and "10,000 characters" in text


async def test_a_slow_tool_times_out_but_a_live_server_is_kept() -> None:
    connection = await ServerConnection(fault_spec()).start()
    try:
        started = time.perf_counter()
        outcome = await call_tool(connection, FAULT_TOOLS, "slow", {"seconds": 30}, CONFIG)
        elapsed = time.perf_counter() - started
        after = await call_tool(connection, FAULT_TOOLS, "echo", {"text": "still here"}, CONFIG)
    finally:
        await connection.close()
    assert outcome.kind == "timeout" and "timed out after 2 s" in outcome.content
    assert elapsed < 15 and after.content == "still here"


async def test_a_hung_server_fails_the_call_and_the_shared_server_is_restarted() -> None:
    pool = ServerPool(fault_spec(), "shared")
    try:
        async with pool.lease() as hung:
            assert (await call_tool(hung, FAULT_TOOLS, "counter", {}, CONFIG)).content == "1"
            with pytest.raises(ServerFailure) as failure:
                await call_tool(hung, FAULT_TOOLS, "hang", {}, CONFIG)
            await pool.report_failure(hung, failure.value.reason, hung=failure.value.hung)
        assert failure.value.hung and "did not answer a ping" in failure.value.reason
        async with pool.lease() as fresh:
            assert fresh is not hung
            assert (
                await call_tool(fresh, FAULT_TOOLS, "counter", {}, CONFIG)
            ).content == "1"  # a new process
    finally:
        await pool.close()
    assert (pool.stats.failures, pool.stats.hangs, pool.stats.restarts, pool.stats.starts) == (1, 1, 1, 2)


async def test_server_starts_take_turns_and_the_timeout_counts_from_each_turn(tmp_path: Path) -> None:
    """Six per-rollout servers that each take 2 s to start, two at a time, under a 4 s handshake
    timeout: they start in three waves (6 s or more in all) and none times out waiting its turn
    (each start keeps 2 s for the SDK's import on a busy machine)."""
    pool = ServerPool(
        fault_spec("--slow-start", "2"), "per-rollout", log_path=tmp_path / "log",
        start_timeout_s=4.0, max_starting=2,
    )  # fmt: skip
    leased = asyncio.Event()
    count = 0

    async def rollout() -> str:
        nonlocal count
        async with pool.lease() as connection:
            count += 1
            if count == 6:
                leased.set()
            await leased.wait()  # every server is up at once: only their starts took turns
            return (await call_tool(connection, FAULT_TOOLS, "counter", {}, CONFIG)).content

    started = time.perf_counter()
    answers = await asyncio.gather(*(rollout() for _ in range(6)))
    elapsed = time.perf_counter() - started
    assert answers == ["1"] * 6 and pool.stats.starts == 6 and pool.stats.start_failures == 0
    assert elapsed >= 6.0
    with pytest.raises(ValueError, match="max_starting must be at least 1"):
        ServerPool(fault_spec(), max_starting=0)


async def test_a_crash_mid_session_is_a_server_failure(tmp_path: Path) -> None:
    pool = ServerPool(fault_spec(), "per-rollout", log_path=tmp_path / "log")
    async with pool.lease() as connection:
        with pytest.raises(ServerFailure) as failure:
            await call_tool(connection, FAULT_TOOLS, "crash", {}, CONFIG)
        assert not failure.value.hung and "closed the connection" in failure.value.reason
        with pytest.raises(ServerFailure):  # every later call on the dead session fails the same way
            await call_tool(connection, FAULT_TOOLS, "echo", {"text": "x"}, CONFIG)
        await pool.report_failure(connection, failure.value.reason, hung=False)
    async with pool.lease() as next_one:
        assert (await call_tool(next_one, FAULT_TOOLS, "echo", {"text": "ok"}, CONFIG)).content == "ok"
    assert pool.stats.failures == 1 and pool.stats.restarts == 1


async def test_a_server_that_dies_at_start_is_a_clear_error(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    started = time.perf_counter()
    with pytest.raises(ServerStartError) as error:
        await ServerConnection(fault_spec("--die-at-start"), log_path=log).start()
    message = str(error.value)
    assert "could not connect to MCP server" in message and "dying at start as asked" in message
    assert time.perf_counter() - started < 20
    with pytest.raises(ServerStartError, match="No such file"):
        await ServerConnection(ServerSpec(command="no-such-mcp-server-xyz")).start()


def test_server_spec_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ServerSpecError, match="exactly one"):
        spec_from_cli(server=None, url=None)
    with pytest.raises(ServerSpecError, match="KEY=VALUE"):
        spec_from_cli(server="x", url=None, env=["NOVALUE"])
    with pytest.raises(ServerSpecError, match="http"):
        spec_from_cli(server=None, url="ftp://x")
    with pytest.raises(ServerSpecError, match="--header applies"):
        spec_from_cli(server="x", url=None, headers=["A: b"])
    spec = spec_from_cli(server=f"{sys.executable} -c 'print(1)'", url=None, env=["A=1=2"])
    assert spec.args == ("-c", "print(1)") and dict(spec.env) == {"A": "1=2"}


async def test_env_reaches_a_stdio_server(tmp_path: Path) -> None:
    """--env passes variables the SDK would not (stdio servers inherit almost none)."""
    script = tmp_path / "env_server.py"
    script.write_text(
        "import os\nfrom mcp.server.mcpserver import MCPServer\ns = MCPServer('env')\n"
        "@s.tool()\ndef get(name: str) -> str:\n    return os.environ.get(name, 'unset')\ns.run()\n"
    )
    spec = spec_from_cli(server=f"{sys.executable} {script}", url=None, env=["MCP_RL_TEST_VAR=hello"])
    connection = await ServerConnection(spec).start()
    try:
        value = await call_tool(connection, {"get"}, "get", {"name": "MCP_RL_TEST_VAR"}, CONFIG)
        home_only = await call_tool(connection, {"get"}, "get", {"name": "PYTEST_CURRENT_TEST"}, CONFIG)
    finally:
        await connection.close()
    assert value.content == "hello" and home_only.content == "unset"
