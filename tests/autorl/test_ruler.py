"""RULER: prompt (golden files), answer validation, and the judge transport end to end.

The transport tests talk to a SCRIPTED judge server (`scripted_judge_server`): a real FastAPI app
on 127.0.0.1 whose POST /v1/chat/completions returns canned answers from a queue and records
every request. Each failure mode goes through the real clients (the `openai` client for
`base_url` judges, LiteLLM's `openai/` route with `api_base` otherwise). The last test uses a
real local judge: SmolLM2 served by our own server.

Rewrite the golden files with `UPDATE_GOLDEN=1 pytest tests/autorl/test_ruler.py` and review the diff.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.server.app import serve_in_thread
from autorl.judge import JudgeConfig, JudgeError, JudgeResponseError, clear_memory_cache, response_format
from autorl.judging import RulerConfig
from autorl.ruler import (
    DEFAULT_RUBRIC,
    TooFewTrajectoriesError,
    build_judge_messages,
    judge_response_fallback_schema,
    judge_response_schema,
    parse_scores,
    ruler,
    ruler_score_group,
    scored_groups,
)
from tests.helpers_judge import Reply, ScriptedJudge, judge_fixtures, judge_for

scripted_judge_server, transport = judge_fixtures()

SAMPLED = RulerConfig(mode="sampled")
"""These tests are about the sampled-JSON judge; the scripted server is on 127.0.0.1, where
mode="auto" would pick the local (logprob) mode."""

GOLDEN = Path(__file__).parent / "golden" / "ruler"

SYSTEM = {
    "role": "system",
    "content": "You are the friendly assistant of a fruit stand. Answer in one sentence.",
}
USER = {"role": "user", "content": "Which fruit should I buy today?"}
REPLIES = [
    "Bananas: they are ripe, sweet and on offer today.",
    "I don't know.",
    "Maybe apples, or pears — both are in season.",
]

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def tool_call(call_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def weather_trajectories() -> list[list[dict[str, Any]]]:
    """Three attempts at one weather question: a correct tool use, no tool use, a wrong city first."""
    system = {"role": "system", "content": "Answer weather questions with the get_weather tool."}
    user = {"role": "user", "content": "Do I need an umbrella in Zürich right now?"}
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"city": "Zürich", "rain_mm": 2.5}'}
    return [
        [
            system,
            user,
            {"role": "assistant", "content": None, "tool_calls": [tool_call("call_1", "Zürich")]},
            result,
            {"role": "assistant", "content": "Yes: it is raining in Zürich (2.5 mm)."},
        ],
        [system, user, {"role": "assistant", "content": "No, Zürich is always sunny."}],
        [
            system,
            user,
            {"role": "assistant", "content": None, "tool_calls": [tool_call("call_0", "Zurich, Kansas")]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"error": "unknown city"}'},
            {"role": "assistant", "content": None, "tool_calls": [tool_call("call_1", "Zürich")]},
            result,
            {"role": "assistant", "content": "Yes, take an umbrella."},
        ],
    ]


def fruit_lists() -> list[list[dict[str, Any]]]:
    return [[SYSTEM, USER, {"role": "assistant", "content": r}] for r in REPLIES]


def fruit_group(rewards: tuple[float | None, ...] = (1.0, 0.0, 0.5)) -> TrajectoryGroup:
    return TrajectoryGroup(
        Trajectory(messages=m, reward=r, metadata={"scenario": "fruit"})
        for m, r in zip(fruit_lists(), rewards, strict=True)
    )


def answer(*scores: tuple[str, float], **extra: Any) -> str:
    """A judge answer as JSON text, with the given (id, score) pairs in the given order."""
    items = [{"trajectory_id": i, "explanation": f"why {i}", "score": s} for i, s in scores]
    return json.dumps({"scores": items, **extra})


GOOD = answer(("1", 0.9), ("2", 0.1), ("3", 0.5))


@pytest.fixture(autouse=True)
def _fresh_memory_cache() -> Iterator[None]:
    clear_memory_cache()
    yield
    clear_memory_cache()


# -- golden prompts -----------------------------------------------------------------------------


def check_golden(name: str, messages: list[dict[str, Any]]) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 and review it"
    assert messages == json.loads(path.read_text(encoding="utf-8")), f"prompt differs from {path}"


def test_judge_prompt_basic_matches_golden() -> None:
    messages = build_judge_messages(fruit_lists())
    check_golden("judge_prompt_basic.json", messages)
    user = messages[1]["content"]
    # the shared system + user messages appear once, in <context>; each reply in its trajectory
    assert user.count(SYSTEM["content"]) == 1 and user.count(USER["content"]) == 1
    assert user.index("<context>") < user.index('<trajectory id="1">') < user.index('<trajectory id="3">')
    assert "<tools>" not in user
    assert DEFAULT_RUBRIC.strip() in messages[0]["content"]


def test_judge_prompt_tools_matches_golden() -> None:
    messages = build_judge_messages(weather_trajectories(), tools=WEATHER_TOOLS)
    check_golden("judge_prompt_tools.json", messages)
    user = messages[1]["content"]
    assert user.startswith("<tools>\n") and '"get_weather"' in user.split("</tools>")[0]
    assert "Zürich" in user  # ensure_ascii=False: text is shown as written


def test_judge_prompt_is_deterministic_and_pure() -> None:
    lists = weather_trajectories()
    snapshot = json.dumps(lists)
    assert build_judge_messages(lists, tools=WEATHER_TOOLS) == build_judge_messages(
        weather_trajectories(), tools=WEATHER_TOOLS
    )
    assert json.dumps(lists) == snapshot


def test_judge_prompt_without_common_prefix_has_no_context() -> None:
    lists = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    user = build_judge_messages(lists, rubric="Prefer a.")[1]["content"]
    assert "<context>" not in user and '"content": "a"' in user and '"content": "b"' in user
    assert build_judge_messages(lists, rubric="Prefer a.")[0]["content"].endswith(
        "Grading standards:\nPrefer a."
    )


def test_response_schema_names_every_id_once_in_order() -> None:
    schema = judge_response_schema(["1", "2", "3"])
    scores = schema["properties"]["scores"]
    assert schema["required"] == ["scores"] and schema["additionalProperties"] is False
    assert scores["minItems"] == scores["maxItems"] == 3 and scores["items"] is False
    positions = scores["prefixItems"]
    assert [p["properties"]["trajectory_id"] for p in positions] == [
        {"type": "string", "const": i} for i in ("1", "2", "3")
    ]
    for item in positions:
        assert item["properties"]["score"] == {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "multipleOf": 0.01,
        }
        assert set(item["required"]) == {"trajectory_id", "explanation", "score"}
        assert item["additionalProperties"] is False


def test_fallback_schema_has_the_same_shape_without_prefix_items() -> None:
    schema = judge_response_fallback_schema(["1", "2"], explanation_max_chars=50)
    scores = schema["properties"]["scores"]
    assert "prefixItems" not in json.dumps(schema) and scores["minItems"] == scores["maxItems"] == 2
    assert scores["items"]["properties"]["trajectory_id"]["enum"] == ["1", "2"]
    assert scores["items"]["properties"]["explanation"]["maxLength"] == 50


@pytest.mark.parametrize("seed", range(6))
def test_any_answer_constrained_to_the_schema_is_valid(tiny_model: Any, seed: int) -> None:
    """Our server's constraint (llguidance) with random logits, the worst judge there is: every
    answer it lets through parses, with each id exactly once (the schema before had duplicates)."""
    import torch

    from art_core.engine.grammar import RowConstraint, json_schema_grammar

    ids = ["1", "2", "3", "4"]
    tokenizer, vocab = tiny_model.tokenizer, tiny_model.model.config.vocab_size
    schema = judge_response_schema(ids, explanation_max_chars=24)
    constraint = RowConstraint(json_schema_grammar(schema, "ruler_scores"), tokenizer, vocab)
    generator = torch.Generator().manual_seed(seed)
    eos, tokens = tokenizer.convert_tokens_to_ids("<|im_end|>"), []
    for _ in range(600):
        logits = torch.randn(vocab, generator=generator) * 3
        constraint.mask_(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token == eos:
            break
        constraint.consume(token)
        tokens.append(token)
    else:
        raise AssertionError("the grammar never completed")
    scores = parse_scores(tokenizer.decode(tokens), ids)
    assert [s.trajectory_id for s in scores] == ids and all(0 <= s.score <= 1 for s in scores)
    assert all(round(s.score, 2) == s.score for s in scores)  # multipleOf 0.01


# -- parse_scores -------------------------------------------------------------------------------

IDS = ["1", "2", "3"]


def test_parse_scores_matches_by_id_not_order() -> None:
    scores = parse_scores(answer(("3", 0.25), ("1", 1.0), ("2", 0.0)), IDS)
    assert [(s.trajectory_id, s.score, s.explanation) for s in scores] == [
        ("1", 1.0, "why 1"),
        ("2", 0.0, "why 2"),
        ("3", 0.25, "why 3"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        f"```json\n{GOOD}\n```",
        f"Here is my judgement:\n\n{GOOD}\n\nI hope this helps.",
        f"Thinking about {{the}} options first.\n```\n{GOOD}\n```",
    ],
    ids=["fenced", "prose-around", "braces-in-prose"],
)
def test_parse_scores_tolerates_fences_and_prose(text: str) -> None:
    assert [s.score for s in parse_scores(text, IDS)] == [0.9, 0.1, 0.5]


def test_parse_scores_accepts_integer_ids() -> None:
    text = json.dumps(
        {
            "scores": [
                {"trajectory_id": 2, "explanation": "x", "score": 1},
                {"trajectory_id": 1, "explanation": "y", "score": 0},
            ]
        }
    )
    assert [(s.trajectory_id, s.score) for s in parse_scores(text, ["1", "2"])] == [("1", 0.0), ("2", 1.0)]


def entries(*items: Any) -> str:
    return json.dumps({"scores": list(items)})


def e(tid: Any, score: Any = 0.5, explanation: Any = "ok") -> dict[str, Any]:
    return {"trajectory_id": tid, "explanation": explanation, "score": score}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("I think trajectory 1 is best.", "invalid JSON"),
        ('{"scores": [{"trajectory_id": "1", "score": 0.5', "invalid JSON"),
        ("", "invalid JSON"),
        (json.dumps({"ratings": []}), 'missing "scores"'),
        (json.dumps({"scores": {"1": 0.5}}), '"scores" must be a list'),
        (entries(e("1"), e("2")), "expected 3 scores"),
        (entries(e("1"), e("2"), e("3"), e("3")), "duplicate trajectory_id '3'"),
        (entries(e("1"), e("2"), e("4")), "unknown trajectory_id '4'"),
        (entries(e("1"), e("2"), e("2")), "missing scores for trajectory ids ['3']"),
        (entries(e("1", 1.5), e("2"), e("3")), "score 1.5 outside [0, 1]"),
        (entries(e("1", -0.1), e("2"), e("3")), "score -0.1 outside [0, 1]"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "x", "score": NaN}]}', "NaN"),
        (entries(e("1", "high"), e("2"), e("3")), "non-numeric score 'high'"),
        (entries(e("1", True), e("2"), e("3")), "non-numeric score True"),
        (entries(e("1", None), e("2"), e("3")), "non-numeric score None"),
        (entries({"trajectory_id": "1", "score": 0.5}, e("2"), e("3")), "missing its explanation"),
        (entries(e("1", explanation=3), e("2"), e("3")), "missing its explanation"),
        (entries({"explanation": "x", "score": 0.5}, e("2"), e("3")), "no string trajectory_id"),
        (entries("1", e("2"), e("3")), "scores[0] is a str"),
        (f"{GOOD}\n{GOOD}", "2 JSON objects with 'scores'"),
    ],
)
def test_parse_scores_rejects_invalid_answers(text: str, reason: str) -> None:
    with pytest.raises(JudgeResponseError) as info:
        parse_scores(text, IDS)
    assert reason in str(info.value)
    assert info.value.attempts == [text]


def test_parse_scores_names_every_problem() -> None:
    text = entries(e("1", 2.0), e("1"), e("9"))
    message = str(pytest.raises(JudgeResponseError, parse_scores, text, IDS).value)
    for reason in (
        "score 2.0 outside",
        "duplicate trajectory_id '1'",
        "unknown trajectory_id '9'",
        "['2', '3']",
    ):
        assert reason in message


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"model": ""}, "non-empty"),
        ({"model": "m", "base_url": "localhost:8000/v1"}, "http(s) URL"),
        ({"model": "m", "max_attempts": 0}, "max_attempts"),
        ({"model": "m", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "temperature": 3.0}, "temperature"),
        ({"model": "m", "extra_params": {"response_format": {"type": "json_object"}}}, "structured_output"),
        ({"model": "m", "extra_params": {"temperature": 1.0}}, "JudgeConfig.temperature"),
        ({"model": "m", "api_key": "a", "extra_params": {"api_key": "b"}}, "keep one"),
    ],
)
def test_judge_config_rejects_bad_settings(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        JudgeConfig(**kwargs)


def test_judge_config_extra_params_are_frozen_copies() -> None:
    params = {"api_base": "http://x/v1"}
    config = JudgeConfig(model="openai/m", extra_params=params, cache_dir="judge-cache")  # type: ignore[arg-type]
    params["api_base"] = "changed"
    assert config.endpoint == "http://x/v1" and config.cache_dir == Path("judge-cache")
    with pytest.raises(TypeError):
        config.extra_params["timeout"] = 1  # type: ignore[index]


def shown_ids(request: dict[str, Any]) -> list[str]:
    schema = request["response_format"]["json_schema"]["schema"]
    positions = schema["properties"]["scores"]["prefixItems"]
    return [p["properties"]["trajectory_id"]["const"] for p in positions]


async def test_valid_answer_sends_prompt_and_strict_schema(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.script(GOOD)
    scores = await ruler(fruit_lists(), judge_for(server, transport), config=SAMPLED)
    assert [(s.trajectory_id, s.score) for s in scores] == [("1", 0.9), ("2", 0.1), ("3", 0.5)]
    (request,) = server.requests
    assert request["model"] == server.model
    assert request["messages"] == build_judge_messages(fruit_lists())
    assert request["temperature"] == 0.0 and request["max_tokens"] == 2048
    assert request["response_format"] == response_format(judge_response_schema(IDS))
    assert request["response_format"]["json_schema"]["strict"] is True


async def test_shuffled_scores_are_matched_by_id(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    scripted_judge_server.script(answer(("2", 0.2), ("3", 0.3), ("1", 0.1)))
    group = await ruler_score_group(
        fruit_group(), judge_for(scripted_judge_server, transport), config=SAMPLED
    )
    assert [t.reward for t in group.trajectories] == [0.1, 0.2, 0.3]
    assert [t.logs[-1] for t in group.trajectories] == [
        "RULER score 0.100: why 1",
        "RULER score 0.200: why 2",
        "RULER score 0.300: why 3",
    ]


async def test_invalid_answer_is_retried_with_the_reason(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    bad = answer(("1", 0.9), ("2", 0.1))  # one score short
    server.script(bad, GOOD)
    group = await ruler_score_group(fruit_group(), judge_for(server, transport), config=SAMPLED)
    assert [t.reward for t in group.trajectories] == [0.9, 0.1, 0.5]
    assert group.metrics["ruler_attempts"] == 2 and group.metrics["ruler_errors"] == 0
    assert len(server.requests) == 2
    retry = server.requests[1]["messages"]
    assert retry[:2] == server.requests[0]["messages"]
    assert retry[2] == {"role": "assistant", "content": bad}
    assert retry[3]["role"] == "user" and "expected 3 scores" in retry[3]["content"]


async def test_cut_off_answer_says_so(scripted_judge_server: ScriptedJudge) -> None:
    server = scripted_judge_server
    server.script(Reply('{"scores": [{"trajectory_id": "1", "expl', finish_reason="length"), GOOD)
    await ruler(fruit_lists(), judge_for(server, "openai", max_tokens=16), config=SAMPLED)
    assert "cut off at max_tokens=16" in server.requests[1]["messages"][-1]["content"]


async def test_always_invalid_raises_with_every_reason(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.script(
        "not json", answer(("1", 1.5), ("2", 0.1), ("3", 0.5)), answer(("1", 0.5), ("2", 0.1), ("7", 0.5))
    )
    with pytest.raises(JudgeResponseError) as info:
        await ruler_score_group(fruit_group(), judge_for(server, transport), config=SAMPLED)
    message = str(info.value)
    assert "3 attempt(s)" in message and "attempt 1: invalid JSON" in message
    assert "outside [0, 1]" in message and "unknown trajectory_id '7'" in message
    assert len(info.value.attempts) == 3 and info.value.attempts[0] == "not json"
    assert len(server.requests) == 3


async def test_always_invalid_is_counted_never_zero(
    scripted_judge_server: ScriptedJudge, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = scripted_judge_server
    server.script(*["{}"] * 3)
    original = fruit_group()
    with caplog.at_level(logging.WARNING, logger="autorl.ruler"):
        failed = await ruler_score_group(
            original, judge_for(server, transport), on_error="count", config=SAMPLED
        )
    assert failed.metrics["ruler_errors"] == 1
    assert all(t.reward is None for t in failed.trajectories)
    assert [t.metrics["independent_reward"] for t in failed.trajectories] == [1.0, 0.0, 0.5]
    assert "ruler_score" not in failed.trajectories[0].metrics
    assert 'missing "scores"' in failed.logs[-1]
    assert any("RULER failed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with pytest.raises(ValueError, match="no reward"):
        failed.trajectories[0].checked_reward()  # training refuses it loudly
    assert [t.reward for t in original.trajectories] == [1.0, 0.0, 0.5]  # the input is untouched

    server.script(GOOD)
    ok = await ruler_score_group(
        fruit_group(), judge_for(server, transport), on_error="count", config=SAMPLED
    )
    kept, errors = scored_groups([failed, ok])
    assert kept == [ok] and errors == 1


async def test_400_on_response_format_retries_without_it(
    scripted_judge_server: ScriptedJudge, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = scripted_judge_server
    server.reject_response_format = True
    server.script(GOOD, answer(("1", 0.3), ("2", 0.7)))
    config = judge_for(server, transport)
    with caplog.at_level(logging.INFO, logger="autorl.judge"):
        scores = await ruler(fruit_lists(), config, config=SAMPLED)
    assert [s.score for s in scores] == [0.9, 0.1, 0.5]
    # the exact schema, then the fallback schema, then none
    assert [("prefixItems" in json.dumps(r.get("response_format"))) for r in server.requests] == [
        True,
        False,
        False,
    ]
    assert [("response_format" in r) for r in server.requests] == [True, True, False]
    assert any("answered 400 to response_format" in r.getMessage() for r in caplog.records)
    # remembered: the next judgement goes straight without response_format
    await ruler(fruit_lists()[:2], config, config=SAMPLED)
    assert [("response_format" in r) for r in server.requests] == [True, True, False, False]


async def test_strict_mode_without_prefix_items_gets_the_fallback_schema(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    """Like OpenAI's strict mode: 400 to `prefixItems`, fine with the per-item enum schema."""
    server = scripted_judge_server
    server.reject_prefix_items = True
    server.script(GOOD, answer(("1", 0.3), ("2", 0.7)))
    config = judge_for(server, transport)
    assert [s.score for s in await ruler(fruit_lists(), config, config=SAMPLED)] == [0.9, 0.1, 0.5]
    fallback = response_format(judge_response_fallback_schema(IDS))
    assert [r.get("response_format") for r in server.requests[1:]] == [fallback]
    await ruler(fruit_lists()[:2], config, config=SAMPLED)  # remembered: the fallback at once
    assert server.requests[2]["response_format"] == response_format(
        judge_response_fallback_schema(["1", "2"])
    )
    assert len(server.requests) == 3


async def test_transport_errors_are_retried(scripted_judge_server: ScriptedJudge, transport: str) -> None:
    server = scripted_judge_server
    server.script(Reply(status=500), Reply(status=503), GOOD)
    scores = await ruler(fruit_lists(), judge_for(server, transport), config=SAMPLED)
    assert [s.score for s in scores] == [0.9, 0.1, 0.5] and len(server.requests) == 3


async def test_unreachable_judge_raises_judge_error(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.script(*[Reply(status=500)] * 3)
    with pytest.raises(JudgeError) as info:
        await ruler(fruit_lists(), judge_for(server, transport), config=SAMPLED)
    assert not isinstance(info.value, JudgeResponseError)
    assert "could not be called in 3 attempt(s)" in str(info.value) and len(server.requests) == 3


async def test_auth_error_fails_fast(scripted_judge_server: ScriptedJudge, transport: str) -> None:
    server = scripted_judge_server
    server.script(Reply(status=401), GOOD)
    with pytest.raises(JudgeError, match="api_key") as info:
        await ruler(fruit_lists(), judge_for(server, transport), config=SAMPLED)
    assert len(info.value.attempts) == 1 and len(server.requests) == 1


async def test_cache_hit_makes_no_request(
    scripted_judge_server: ScriptedJudge, transport: str, tmp_path: Path
) -> None:
    server = scripted_judge_server
    server.script(GOOD)
    config = judge_for(server, transport, cache_dir=tmp_path / "cache")
    first = await ruler_score_group(fruit_group(), config, config=SAMPLED)
    again = await ruler_score_group(fruit_group(), config, config=SAMPLED)
    assert len(server.requests) == 1 and again.metrics["ruler_attempts"] == 0
    assert [t.reward for t in again.trajectories] == [t.reward for t in first.trajectories]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    clear_memory_cache()  # a new process: the answer comes from disk
    from_disk = await ruler(fruit_lists(), config, config=SAMPLED)
    assert [s.score for s in from_disk] == [0.9, 0.1, 0.5] and len(server.requests) == 1
    # another rubric is another prompt; cache=False always asks
    server.script(GOOD, GOOD)
    await ruler(fruit_lists(), config, rubric="Prefer bananas.", config=SAMPLED)
    await ruler(fruit_lists(), judge_for(server, transport, cache=False), config=SAMPLED)
    assert len(server.requests) == 3


async def test_identical_trajectories_are_judged_once(scripted_judge_server: ScriptedJudge) -> None:
    server = scripted_judge_server
    same = fruit_lists()[0]
    server.script(answer(("1", 0.8)), answer(("1", 0.9), ("2", 0.2)))
    scores = await ruler([same, same, same], judge_for(server, "openai"), config=SAMPLED)
    assert [(s.trajectory_id, s.score) for s in scores] == [("1", 0.8), ("2", 0.8), ("3", 0.8)]
    assert shown_ids(server.requests[0]) == ["1"]
    assert server.requests[0]["messages"] == build_judge_messages([same])  # no <context>: all of it is shown
    # duplicates among distinct ones: the judge sees each once and they share a score
    other = fruit_lists()[1]
    scores = await ruler([same, other, same], judge_for(server, "openai"), config=SAMPLED)
    assert [s.score for s in scores] == [0.9, 0.2, 0.9] and shown_ids(server.requests[1]) == ["1", "2"]


# -- ruler_score_group --------------------------------------------------------------------------


async def test_score_group_keeps_independent_reward(scripted_judge_server: ScriptedJudge) -> None:
    server = scripted_judge_server
    server.script(GOOD)
    original = fruit_group(rewards=(1.0, None, 0.5))
    original.trajectories[0].logs.append("rollout log")
    scored = await ruler_score_group(original, judge_for(server, "openai"), config=SAMPLED)
    assert scored is not original and scored.trajectories[0] is not original.trajectories[0]
    first, second, third = scored.trajectories
    assert first.metrics == {"independent_reward": 1.0, "ruler_score": 0.9} and first.reward == 0.9
    assert "independent_reward" not in second.metrics and second.reward == 0.1
    assert third.metrics["independent_reward"] == 0.5 and third.reward == 0.5
    assert first.logs == ["rollout log", "RULER score 0.900: why 1"]
    assert first.metadata == {"scenario": "fruit"}
    assert [t.reward for t in original.trajectories] == [1.0, None, 0.5] and original.trajectories[
        0
    ].metrics == {}


async def test_score_group_shows_the_tools(scripted_judge_server: ScriptedJudge) -> None:
    server = scripted_judge_server
    server.script(GOOD)
    group = TrajectoryGroup(Trajectory(messages=m, tools=WEATHER_TOOLS) for m in weather_trajectories())
    await ruler_score_group(group, judge_for(server, "openai"), config=SAMPLED)
    assert server.requests[0]["messages"] == build_judge_messages(weather_trajectories(), tools=WEATHER_TOOLS)


async def test_score_group_needs_two_trajectories(scripted_judge_server: ScriptedJudge) -> None:
    config = judge_for(scripted_judge_server, "openai")
    single = TrajectoryGroup([Trajectory(messages=fruit_lists()[0], reward=1.0)])
    with pytest.raises(TooFewTrajectoriesError, match="at least 2"):
        await ruler_score_group(single, config, config=SAMPLED)
    counted = await ruler_score_group(single, config, on_error="count", config=SAMPLED)
    assert counted.metrics["ruler_errors"] == 1 and counted.trajectories[0].reward is None
    assert "at least 2" in counted.logs[-1] and not scripted_judge_server.requests
    with pytest.raises(ValueError, match="on_error"):
        await ruler_score_group(single, config, on_error="ignore", config=SAMPLED)  # type: ignore[arg-type]


# -- a real local judge: SmolLM2 on our own server ----------------------------------------------


def _server_takes_json_schema() -> bool:
    """Whether our server accepts response_format json_schema (constrained decoding) yet."""
    try:
        from art_core.server.errors import APIError
        from art_core.server.openai_format import ChatCompletionRequest, check_supported
    except ImportError:
        return True  # the check moved: assume it is supported and let the test tell
    request = ChatCompletionRequest.model_validate(
        {
            "model": "judge",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": response_format(judge_response_schema(["1", "2"])),
        }
    )
    try:
        check_supported(request)
    except APIError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(
    not _server_takes_json_schema(),
    reason="our server rejects response_format json_schema (constrained decoding not there yet)",
)
async def test_real_local_judge_on_our_server(smollm2: Any, caplog: pytest.LogCaptureFixture) -> None:
    from art_core.engine.config import EngineConfig
    from art_core.engine.torch.engine import TorchEngine
    from art_core.server.app import create_app
    from art_core.server.router import ServedModel, StaticRouter

    engine = TorchEngine(smollm2.model, smollm2.tokenizer, EngineConfig())
    served = ServedModel(
        engine=engine, tokenizer=smollm2.tokenizer, adapter=None, max_context=smollm2.max_context
    )
    handle = serve_in_thread(create_app(StaticRouter({"judge": served})))
    try:
        config = JudgeConfig(
            model="judge", base_url=handle.url + "/v1", max_tokens=400, cache=False, explanation_max_chars=160
        )
        with caplog.at_level(logging.INFO, logger="autorl.judge"):
            scores = await ruler(fruit_lists()[:2], config, config=SAMPLED)
    finally:
        handle.stop()
        engine.close()
    assert [s.trajectory_id for s in scores] == ["1", "2"]
    assert all(0.0 <= s.score <= 1.0 and math.isfinite(s.score) and s.explanation for s in scores)
    assert not any("answered 400" in r.getMessage() for r in caplog.records), "structured output was refused"
