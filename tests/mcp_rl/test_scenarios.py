"""Scenario files (load, save, checks), generation (autorl.inputs underneath) through our own server,
and the shaped check reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_core.model import TrainableModel
from art_core.types import Trajectory, TrajectoryGroup
from autorl.inputs import TooFewInputsError, assign_splits, dedupe
from mcp_rl.catalog import ServerCatalog, openai_tool
from mcp_rl.generation import TooFewScenariosError, generate_scenarios, names_a_tool
from mcp_rl.pipeline import endpoint
from mcp_rl.rewards import MAX_PARTIAL, PARTS, check_credit, credit_parts, score_group
from mcp_rl.scenarios import Scenario, ScenarioFileError, check_answer, load_scenarios, save_scenarios
from tests.helpers_mcp import EXAMPLE_SCENARIOS
from tests.helpers_serving import served_fixture

served = served_fixture("mcp_rl_scenarios", project="mcp-rl-scen", name="gen")


def test_scenario_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    scenarios = load_scenarios(EXAMPLE_SCENARIOS)
    path = save_scenarios(tmp_path / "s.jsonl", scenarios)
    assert load_scenarios(path) == scenarios
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "task": "Count the figs.", "difficulty": 9}\n')
    with pytest.raises(ScenarioFileError, match=r"bad.jsonl:1: .*difficulty must be an integer from 1 to 5"):
        load_scenarios(bad)
    bad.write_text('{"id": "a", "task": "Count the figs.", "colour": "red"}\n')
    with pytest.raises(ScenarioFileError, match="unknown field"):
        load_scenarios(bad)
    bad.write_text(
        '# a comment\n{"id": "a", "task": "Count the figs."}\n{"id": "a", "task": "Count the figs again."}\n'
    )
    with pytest.raises(ScenarioFileError, match="duplicate scenario ids"):
        load_scenarios(bad)
    with pytest.raises(ValueError, match="numeric expected answer"):
        Scenario(id="x", task="Count the figs.", expected="four", check="number")


def test_check_answer_kinds() -> None:
    number = Scenario(id="n", task="How many?", expected="0.75", check="number")
    assert check_answer(number, "It costs 0.750 euros") and not check_answer(number, "It costs 75 cents")
    assert check_answer(Scenario(id="k", task="How many?", expected="1,200", check="number"), "1200 units")
    contains = Scenario(id="c", task="Which?", expected="Paris  France", check="contains")
    assert check_answer(contains, "It is in paris france.") and not check_answer(contains, "Lyon")
    exact = Scenario(id="e", task="Which?", expected="yes", check="exact")
    assert check_answer(exact, " Yes. ") and not check_answer(exact, "yes indeed")
    assert check_answer(Scenario(id="o", task="Describe it."), "anything") is None
    assert check_answer(number, None) is False


def test_no_task_names_a_tool_dedupe_and_splits() -> None:
    tools = ["stock_level", "git_create_branch", "get"]
    assert names_a_tool("Use stock_level to count figs", tools)
    assert names_a_tool("Please git create branch feature", tools)
    assert not names_a_tool("What is the stock level of figs?", ["stock_level_v2"])
    assert not names_a_tool("Get me the figs", tools)  # names of 3 letters or less are common words
    texts = ["How many figs?", "how many  FIGS?", "How many figs ?", "What does a kiwi cost?"]
    assert dedupe(texts) == [0, 3]
    ids = [f"s{i}" for i in range(20)]
    splits = assign_splits(ids, val_fraction=0.25, seed=1)
    assert splits == assign_splits(list(reversed(ids)), val_fraction=0.25, seed=1)  # deterministic
    assert sum(v == "val" for v in splits.values()) == 5
    assert set(assign_splits(["a", "b"], val_fraction=0.1).values()) == {"train", "val"}


CATALOG = ServerCatalog(
    tools=[
        openai_tool(
            "stock_level",
            "How many units of a product are in stock.",
            {"type": "object", "properties": {"product": {"type": "string"}}},
        )
    ],
    server_name="warehouse",
)


@pytest.mark.asyncio(loop_scope="module")
async def test_generation_through_our_server_gives_valid_scenarios_or_says_why(model: TrainableModel) -> None:
    """The tiny random model writes constrained JSON: every scenario kept is valid, distinct, names
    no tool and is split; when too few survive, the error counts what was dropped."""
    generator = endpoint("local", model)
    assert generator is not None
    try:
        scenarios = await generate_scenarios(CATALOG, 4, generator, batch_size=4, max_calls=2)
    except TooFewScenariosError as exc:
        assert isinstance(exc, TooFewInputsError) and "--scenarios" in str(exc)
        assert "2 generator calls" in str(exc) or "usable scenarios of the 4 asked for in 2 calls" in str(exc)
        return
    assert len(scenarios) == 4 and len({s.task for s in scenarios}) == 4
    assert all(1 <= s.difficulty <= 5 and not names_a_tool(s.task, CATALOG.tool_names) for s in scenarios)
    assert {s.split for s in scenarios} == {"train", "val"}


def _rollout(answer: str | None, *results: str) -> Trajectory:
    messages: list[dict[str, object]] = [{"role": "user", "content": "How many kiwis are in stock?"}]
    for n, result in enumerate(results):
        call = {"id": f"c{n}", "type": "function", "function": {"name": "stock_level", "arguments": "{}"}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}]
        messages += [{"role": "tool", "tool_call_id": f"c{n}", "content": result}]
    if answer is not None:
        messages.append({"role": "tool", "tool_call_id": "done", "content": "Task complete."})
    return Trajectory(messages=messages, metadata={"scenario_id": KIWIS.id, "answer": answer})


KIWIS = Scenario(id="v01", task="How many kiwis are in stock?", expected="9", check="number")


def test_the_shaped_check_orders_progress_and_a_pass_always_wins() -> None:
    ladder = [
        _rollout(None),  # never finished
        _rollout("I do not know"),  # finished, no number
        _rollout("I do not know", "Error: unknown product 'kiwi s'"),  # a failed call earns nothing more
        _rollout("There are 40", "12"),  # a tool result, a number far off
        _rollout("There are 8", "12"),  # a closer number
        _rollout("There are 8", "9"),  # looked up the right fact, answered near it
        _rollout("There are 9 kiwis", "9"),  # passes
    ]
    credits = [check_credit(KIWIS, t) for t in ladder]
    assert credits[0] == 0.0 and credits[1] == pytest.approx(PARTS["completed"])
    assert credits[2] == credits[1]
    assert all(
        a is not None and b is not None and a < b for a, b in zip(credits[2:], credits[3:], strict=False)
    )
    assert credits[-1] == 1.0 and max(c for c in credits[:-1] if c is not None) <= MAX_PARTIAL
    weight = 0.7  # the default: a pass with RULER 0 beats any failure with RULER 1
    assert weight * 1.0 > weight * MAX_PARTIAL + (1 - weight)
    assert check_credit(KIWIS, _rollout("There are 9.5")) == credits[1]  # no look-up: no answer-form credit
    assert check_credit(Scenario(id="open", task="Describe the stock."), ladder[-1]) is None
    word = Scenario(id="w", task="Which fruit is cheapest?", expected="kiwis", check="contains")
    assert credit_parts(word, "apples", ["kiwis: 0.75"]) == pytest.approx(
        {"completed": 0.10, "tool_ok": 0.05, "found": 0.25, "typed": 0.05, "close": 0.0}
    )


def test_the_right_look_up_outranks_a_wrong_tool_with_a_near_number() -> None:
    # Run 4's reward hack: ship_order on the named product returns a number near its stock, and an
    # answer with that number must not pay more than looking the stock up without finishing.
    wrong_tool = check_credit(KIWIS, _rollout("There are 8 kiwis", "8"))
    right_look_up = check_credit(KIWIS, _rollout(None, "9"))
    right_look_up_wrong_answer = check_credit(KIWIS, _rollout("There are 40", "9"))
    assert wrong_tool is not None and right_look_up is not None and right_look_up_wrong_answer is not None
    assert right_look_up > wrong_tool
    assert right_look_up_wrong_answer > wrong_tool
    assert check_credit(KIWIS, _rollout("There are 9 kiwis", "9")) == 1.0


@pytest.mark.asyncio(loop_scope="module")
async def test_check_only_scoring_gives_each_rollout_its_credit() -> None:
    group = TrajectoryGroup([_rollout("There are 40", "12"), _rollout("There are 9", "9")])
    scored = await score_group(group, KIWIS, None)
    assert [t.reward for t in scored.trajectories] == [check_credit(KIWIS, t) for t in group.trajectories]
    assert [t.metrics["success"] for t in scored.trajectories] == [False, True]
