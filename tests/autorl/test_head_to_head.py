"""Head-to-head: both orders cancel a judge's position bias, failures are counted and never
scored, and the Wilson interval; against a SCRIPTED judge (its preferences must be known)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from autorl.head_to_head import head_to_head, order_outcome, summarise, wilson_interval
from autorl.judge import clear_memory_cache
from autorl.judging import RulerConfig
from tests.helpers_scripted import Reply, ScriptedLLM, scripted_server

SAMPLED = RulerConfig(mode="sampled")
"""The scripted judge answers JSON only (no logprobs): "auto" would spend a reply probing it."""
PROMPT = [{"role": "system", "content": "Be formal."}, {"role": "user", "content": "hey whats up"}]


def trajectories(body: dict[str, Any]) -> dict[str, str]:
    text = body["messages"][-1]["content"]
    return dict(re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', text, flags=re.S))


def scores(values: dict[str, float]) -> str:
    entries = [{"trajectory_id": k, "explanation": "scripted", "score": v} for k, v in values.items()]
    return json.dumps({"scores": entries})


@pytest.fixture
def scripted_judge() -> Iterator[ScriptedLLM]:
    clear_memory_cache()
    with scripted_server("judge") as llm:
        yield llm


def test_wilson_interval_and_outcomes() -> None:
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-3)
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert [order_outcome(0.9, 0.1), order_outcome(0.5, 0.5), order_outcome(0.1, 0.9)] == [1.0, 0.5, 0.0]
    result = summarise([1.0, 0.75, 0.5, 0.0, None], judge_errors=2)
    assert (result.wins, result.losses, result.ties, result.judged) == (2, 1, 1, 4)
    assert result.win_rate == pytest.approx(2.25 / 4) and result.judge_errors == 2


async def test_a_judge_that_prefers_the_better_answer(scripted_judge: ScriptedLLM) -> None:
    def prefer_good(body: dict[str, Any]) -> str:
        return scores({k: 0.9 if "GOOD" in v else 0.2 for k, v in trajectories(body).items()})

    scripted_judge.responder = prefer_good
    trained = ["GOOD: Good afternoon.", "GOOD reply", "same"]
    baseline = ["yo", "meh", "same"]
    result = await head_to_head(
        [PROMPT] * 3, trained, baseline, judge=scripted_judge.config(), ruler_config=SAMPLED
    )
    assert (result.wins, result.losses, result.ties, result.judge_errors) == (2, 0, 1, 0)
    assert (
        result.win_rate == pytest.approx(2.5 / 3) and len(scripted_judge.requests) == 4
    )  # identical: no call
    firsts = " ".join(trajectories(r)["1"] for r in scripted_judge.requests)
    assert all(
        answer in firsts for answer in ["GOOD: Good afternoon.", "yo", "GOOD reply", "meh"]
    )  # both orders


async def test_position_bias_cancels_out(scripted_judge: ScriptedLLM) -> None:
    scripted_judge.responder = lambda body: scores({"1": 1.0, "2": 0.0})
    result = await head_to_head(
        [PROMPT] * 4,
        ["a", "b", "c", "d"],
        ["w", "x", "y", "z"],
        judge=scripted_judge.config(),
        ruler_config=SAMPLED,
    )
    assert (result.wins, result.losses, result.ties) == (0, 0, 4) and result.win_rate == 0.5


@pytest.mark.parametrize("transport", ["openai", "litellm"])
async def test_judge_garbage_is_counted_not_scored(scripted_judge: ScriptedLLM, transport: str) -> None:
    scripted_judge.responder = lambda body: "I think the first one is better."
    result = await head_to_head(
        [PROMPT] * 2, ["a", "b"], ["x", "y"], judge=scripted_judge.config(transport), ruler_config=SAMPLED
    )
    assert result.judged == 0 and result.win_rate is None and result.judge_errors == 4
    assert result.outcomes == (None, None) and (result.ci_low, result.ci_high) == (0.0, 1.0)


async def test_judge_timeouts_are_counted(scripted_judge: ScriptedLLM) -> None:
    scripted_judge.script(*[Reply(scores({"1": 1.0, "2": 0.0}), delay_s=2.0) for _ in range(2)])
    scripted_judge.responder = lambda body: scores(
        {k: 0.9 if '"content": "a"' in v else 0.1 for k, v in trajectories(body).items()}
    )
    config = scripted_judge.config(max_attempts=1, extra_params={"timeout": 0.5})
    result = await head_to_head(
        [PROMPT] * 2, ["a", "a"], ["x", "x"], judge=config, concurrency=1, ruler_config=SAMPLED
    )
    assert result.judge_errors == 2 and result.outcomes == (None, 1.0) and result.wins == 1
