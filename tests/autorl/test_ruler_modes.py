"""RULER's judging modes for small judges: probability-weighted labels and pairwise Bradley-Terry.

Pure parts (Bradley-Terry, label probabilities, prompts as golden files) are tested directly.
The modes end to end talk to the SCRIPTED judge server of tests/helpers_judge.py (canned top
logprobs, both the `openai` and the LiteLLM transport), including judge garbage, missing
logprobs and timeouts. The slow test uses a real local judge: SmolLM2 on our own server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from art_core.types import Trajectory, TrajectoryGroup
from autorl.bradley_terry import bradley_terry, win_probabilities
from autorl.judge import JudgeConfig
from autorl.judging import LOCAL_MODE, ONE_TO_FIVE, RulerConfig, resolve_mode
from autorl.label_probs import NoLabelProbabilitiesError, NoLogprobsError, label_probabilities
from autorl.pairwise import build_pairwise_messages, pairwise_scores
from autorl.ruler import DEFAULT_RUBRIC, judge_message_lists, ruler, ruler_score_group
from autorl.weighted import build_weighted_messages, weighted_score
from tests.autorl.test_ruler import _fresh_memory_cache, check_golden  # noqa: F401 (an autouse fixture)
from tests.helpers_judge import Reply, ScriptedJudge, judge_fixtures, judge_for, logprob_reply, user_text

scripted_judge_server, transport = judge_fixtures()

SYSTEM = {"role": "system", "content": "You sell fruit. Answer in one sentence."}
USER = {"role": "user", "content": "Which fruit should I buy today?"}
REPLIES = ["Bananas: they are ripe and on offer.", "I don't know.", ""]
WEIGHTED = RulerConfig(mode="weighted")
PAIRWISE = RulerConfig(mode="pairwise")


def lists(replies: list[str] = REPLIES) -> list[list[dict[str, Any]]]:
    return [[SYSTEM, USER, {"role": "assistant", "content": r}] for r in replies]


def group(replies: list[str] = REPLIES) -> TrajectoryGroup:
    return TrajectoryGroup(Trajectory(messages=m) for m in lists(replies))


# -- pure parts ---------------------------------------------------------------------------------


def test_bradley_terry_recovers_known_strengths_in_float64() -> None:
    truth = [4.0, 2.0, 1.0, 0.5]
    wins = [[0.0 if i == j else 10 * a / (a + b) for j, b in enumerate(truth)] for i, a in enumerate(truth)]
    strengths = bradley_terry(wins, prior=0.0, tolerance=1e-14)
    scale = math.prod(truth) ** (1 / len(truth))  # the result has geometric mean 1
    assert strengths == pytest.approx([t / scale for t in truth], rel=1e-9)
    assert math.prod(strengths) == pytest.approx(1.0, rel=1e-12)


def test_bradley_terry_stays_finite_when_one_side_always_wins() -> None:
    strengths = bradley_terry([[0.0, 2.0], [0.0, 0.0]])
    assert all(math.isfinite(s) and s > 0 for s in strengths) and strengths[0] > strengths[1]
    assert bradley_terry([[0.0, 1.0], [1.0, 0.0]]) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="won nothing"):
        bradley_terry([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="square"):
        bradley_terry([[0.0, 1.0]])


def test_win_probabilities_average_the_pairwise_odds() -> None:
    assert win_probabilities([1.0, 1.0, 1.0]) == pytest.approx([0.5, 0.5, 0.5])
    assert win_probabilities([3.0, 1.0]) == pytest.approx([0.75, 0.25])
    assert win_probabilities([2.0]) == [0.5]


def test_pairwise_scores_cancel_position_bias() -> None:
    # the judge always prefers A a little (bias) and prefers item 0 when it is there
    prefs = {(0, 1): 0.9, (1, 0): 0.4, (0, 2): 0.9, (2, 0): 0.4, (1, 2): 0.6, (2, 1): 0.6}
    scores = pairwise_scores(3, prefs)
    assert scores[0] > scores[1] == pytest.approx(scores[2]) and all(0 < s < 1 for s in scores)


def test_label_probabilities_fold_case_and_spaces_and_renormalise() -> None:
    top = {"Yes": math.log(0.3), " yes": math.log(0.1), "No": math.log(0.2), "The": math.log(0.4)}
    assert label_probabilities(top, ["No", "Yes"]) == pytest.approx({"No": 1 / 3, "Yes": 2 / 3})
    assert label_probabilities({"The": -0.1}, ["No", "Yes"]) is None
    assert label_probabilities({"4": -0.5}, ONE_TO_FIVE) == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 1.0, "5": 0.0}


def test_weighted_score_is_the_expected_position() -> None:
    assert weighted_score({"No": 0.25, "Yes": 0.75}, ["No", "Yes"]) == 0.75
    assert weighted_score({"1": 0.5, "5": 0.5}, ONE_TO_FIVE) == 0.5


def test_prompts_match_golden() -> None:
    context, (first, second) = [SYSTEM, USER], [m[2:] for m in lists()[:2]]
    weighted = build_weighted_messages(context, first, DEFAULT_RUBRIC, ["No", "Yes"])
    check_golden("weighted_prompt.json", weighted)
    assert weighted[1]["content"].endswith("Answer Yes or No.") and "Reply: Bananas" in weighted[1]["content"]
    assert (
        "Reply: (no reply)"
        in build_weighted_messages(context, lists()[2][2:], "r", ["No", "Yes"])[1]["content"]
    )
    assert (
        "from 1 (worst) to 5 (best)"
        in build_weighted_messages(context, first, "r", ONE_TO_FIVE)[1]["content"]
    )
    pairwise = build_pairwise_messages(context, first, second, DEFAULT_RUBRIC)
    check_golden("pairwise_prompt.json", pairwise)
    body = pairwise[1]["content"]
    assert body.index("Reply A: Bananas") < body.index("Reply B: I don't know.") and "A or B?" in body


def test_ruler_config_validates_and_auto_picks_by_judge() -> None:
    for bad, reason in [({"mode": "best"}, "mode"), ({"scale": ("Yes",)}, "scale"), ({"scale": ("a", "A")}, "scale"),
                        ({"top_logprobs": 21}, "top_logprobs"), ({"max_concurrency": 0}, "max_concurrency")]:  # fmt: skip
        with pytest.raises(ValueError, match=reason):
            RulerConfig(**bad)
    auto = RulerConfig()
    assert resolve_mode(auto, JudgeConfig(model="m", base_url="http://127.0.0.1:8000/v1")) == LOCAL_MODE
    assert resolve_mode(auto, JudgeConfig(model="ollama/qwen3:0.6b")) == LOCAL_MODE
    assert resolve_mode(auto, JudgeConfig(model="openai/gpt-4.1-mini")) == "sampled"
    assert resolve_mode(auto, JudgeConfig(model="m", base_url="https://openrouter.ai/api/v1")) == "sampled"
    assert resolve_mode(PAIRWISE, JudgeConfig(model="openai/gpt-4.1-mini")) == "pairwise"


# -- weighted mode through the scripted judge ---------------------------------------------------


def prefers_bananas(body: dict[str, Any]) -> Reply:
    """SCRIPTED judge: P(Yes) high for the bananas reply, low otherwise, always some other tokens."""
    good = "Reply: Bananas" in user_text(body)
    return logprob_reply(No=math.log(0.3 if good else 0.8), Yes=math.log(0.6 if good else 0.1), The=-3.0)


async def test_weighted_scores_follow_the_judge_probabilities(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.responder = prefers_bananas
    scored = await ruler_score_group(group(), judge_for(server, transport), config=WEIGHTED)
    rewards = [t.reward for t in scored.trajectories]
    assert rewards[0] == pytest.approx(0.6 / 0.9) and rewards[1] == rewards[2] == pytest.approx(0.1 / 0.9)
    assert scored.metrics["judge_calls"] == 3 and scored.metrics["judge_errors"] == 0
    assert scored.metrics["ruler_errors"] == 0 and scored.metrics["judge_fallbacks"] == 0
    for request in server.requests:
        assert request["logprobs"] is True and request["top_logprobs"] == 20 and request["max_tokens"] == 1
        assert "response_format" not in request
    assert "P No: 0.333, Yes: 0.667" in scored.trajectories[0].logs[-1]


async def test_weighted_garbage_is_retried_then_counted(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    garbage = logprob_reply(Hello=-0.1, The=-2.0)
    server.script(garbage, logprob_reply(Yes=-0.1, No=-2.5), logprob_reply(No=-0.1, Yes=-2.5))
    scored = await ruler_score_group(
        group(REPLIES[:2]), judge_for(server, transport, max_attempts=2), config=WEIGHTED
    )
    assert scored.metrics["judge_calls"] == 3 and scored.metrics["judge_errors"] == 1
    retry = [r for r in server.requests if len(r["messages"]) == 4]
    assert len(retry) == 1 and retry[0]["messages"][-1]["content"] == "Answer with one word: No or Yes."
    assert all(t.reward is not None for t in scored.trajectories)


async def test_weighted_judge_that_never_gives_a_label_fails_the_group(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.responder = lambda body: logprob_reply(Hello=-0.1, The=-2.0)
    config = judge_for(server, transport, max_attempts=2)
    scored = await ruler_score_group(group(), config, on_error="count", config=WEIGHTED)
    assert scored.metrics["ruler_errors"] == 1 and all(t.reward is None for t in scored.trajectories)
    assert scored.metrics["judge_calls"] == 6 and scored.metrics["judge_errors"] == 6
    assert "none of the labels ['No', 'Yes'] is among its top tokens ['Hello', 'The']" in scored.logs[-1]
    with pytest.raises(NoLabelProbabilitiesError, match="weighted judge failed on 3 of 3"):
        await ruler(lists(), config, config=WEIGHTED)


async def test_judge_without_logprobs_fails_at_once(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.responder = lambda body: Reply("Yes")  # answers, but sends no logprobs
    with pytest.raises(NoLogprobsError, match="returned no logprobs") as info:
        await ruler(lists(), judge_for(server, transport), config=WEIGHTED)
    assert info.value.calls == 1 and len(server.requests) == 1  # the first call alone tells; no retries


async def test_auto_falls_back_to_sampled_json_for_a_local_judge_without_logprobs(
    scripted_judge_server: ScriptedJudge,
) -> None:
    server = scripted_judge_server
    sampled = json.dumps({"scores": [{"trajectory_id": str(i), "explanation": "x", "score": s}
                                     for i, s in ((1, 0.9), (2, 0.2), (3, 0.1))]})  # fmt: skip
    server.responder = lambda body: Reply("Yes") if body.get("logprobs") else Reply(sampled)
    scored = await ruler_score_group(group(), judge_for(server, "openai"))  # mode "auto", local URL
    assert [t.reward for t in scored.trajectories] == [0.9, 0.2, 0.1]
    assert scored.metrics["judge_fallbacks"] == 1 and scored.metrics["judge_calls"] == 2
    assert scored.metrics["judge_errors"] == 1 and "'sampled'" in scored.logs[-1]
    # remembered for this endpoint: the next group goes straight to sampled JSON
    again = await ruler_score_group(group(), judge_for(server, "openai", cache=False))
    assert again.metrics["judge_fallbacks"] == 1 and again.metrics["judge_calls"] == 1
    assert [bool(r.get("logprobs")) for r in server.requests] == [True, False, False]


async def test_weighted_timeouts_are_retried_and_counted(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.responder = lambda body: Reply("Yes", top_logprobs={"Yes": -0.1}, delay_s=3.0)
    config = judge_for(server, transport, max_attempts=2, extra_params={"timeout": 0.3})
    scored = await ruler_score_group(group(REPLIES[:2]), config, on_error="count", config=WEIGHTED)
    assert scored.metrics["ruler_errors"] == 1 and scored.metrics["judge_errors"] == 4
    assert "could not be called in 2 attempt(s)" in scored.logs[-1] and "imeout" in scored.logs[-1]


# -- pairwise mode through the scripted judge ---------------------------------------------------


def pairwise_prefers_bananas(body: dict[str, Any]) -> Reply:
    """SCRIPTED judge with a position bias towards A, but P(bananas) high in either position."""
    text = user_text(body)
    if "Reply A: Bananas" in text:
        p_a = 0.9
    elif "Reply B: Bananas" in text:
        p_a = 0.3
    else:
        p_a = 0.6
    return logprob_reply(A=math.log(p_a), B=math.log(1 - p_a))


async def test_pairwise_asks_both_orders_and_ranks_by_bradley_terry(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server
    server.responder = pairwise_prefers_bananas
    judgement = await judge_message_lists(lists(), judge_for(server, transport), config=PAIRWISE)
    scores = [s.score for s in judgement.scores]
    assert scores[0] > scores[1] == pytest.approx(scores[2]) and all(0 < s < 1 for s in scores)
    assert judgement.attempts == 6 and judgement.errors == 0 and judgement.mode == "pairwise"
    shown = sorted(
        (user_text(r).split("Reply A: ")[1][:4], user_text(r).split("Reply B: ")[1][:4])
        for r in server.requests
    )
    assert len(set(shown)) == 6  # every ordered pair once


async def test_pairwise_survives_one_failed_order_but_not_a_whole_pair(
    scripted_judge_server: ScriptedJudge, transport: str
) -> None:
    server = scripted_judge_server

    def one_order_fails(body: dict[str, Any]) -> Reply:
        text = user_text(body)
        if text.find("Reply A: I don't") >= 0 and "Reply B: (no reply)" in text:
            return Reply(status=500)
        return pairwise_prefers_bananas(body)

    server.responder = one_order_fails
    config = judge_for(server, transport, max_attempts=1, cache=False)
    judgement = await judge_message_lists(lists(), config, config=PAIRWISE)
    assert judgement.attempts == 6 and judgement.errors == 1

    server.responder = lambda body: (
        Reply(status=500) if "Bananas" not in user_text(body) else pairwise_prefers_bananas(body)
    )
    scored = await ruler_score_group(group(), config, on_error="count", config=PAIRWISE)
    assert scored.metrics["ruler_errors"] == 1 and scored.metrics["judge_errors"] == 2
    assert "no verdict on 1 of 3 pairs (trajectories 2 and 3" in scored.logs[-1]


async def test_identical_trajectories_share_a_score_in_the_logprob_modes(
    scripted_judge_server: ScriptedJudge,
) -> None:
    server = scripted_judge_server
    server.responder = pairwise_prefers_bananas
    same = lists()[1]
    judgement = await judge_message_lists([same, same], judge_for(server, "openai"), config=PAIRWISE)
    assert [s.score for s in judgement.scores] == [0.5, 0.5] and judgement.attempts == 0
    server.responder = prefers_bananas
    judgement = await judge_message_lists(
        [same, lists()[0], same], judge_for(server, "openai"), config=WEIGHTED
    )
    assert judgement.scores[0].score == judgement.scores[2].score < judgement.scores[1].score
    assert judgement.attempts == 2


# -- a real local judge: SmolLM2 on our own server ----------------------------------------------


@pytest.mark.slow
async def test_smollm2_weighted_judge_prefers_the_right_answer(tmp_path: Path) -> None:
    from art_core import TrainableModel
    from art_core.backends import LocalBackend

    backend = LocalBackend(tmp_path)
    try:
        model = TrainableModel(project="ruler-modes", name="judge", base_model="smollm2-135m")
        await model.register(backend)
        judge = JudgeConfig(model=model.get_inference_name(), base_url=model.inference_base_url,
                            api_key=model.inference_api_key, cache=False)  # fmt: skip
        system = {
            "role": "system",
            "content": "You are a helpful assistant. Answer the user's question correctly.",
        }
        question = {"role": "user", "content": "What is the capital of France?"}
        replies = ["The capital of France is Paris.", "I like to watch football on Sundays."]
        scored = await ruler_score_group(
            TrajectoryGroup(
                Trajectory(messages=[system, question, {"role": "assistant", "content": r}]) for r in replies
            ),
            judge,  # mode "auto": a local judge gets the weighted mode
        )
    finally:
        await backend.close()
    assert scored.metrics["judge_fallbacks"] == 0 and scored.metrics["judge_errors"] == 0
    right, off_topic = (t.reward for t in scored.trajectories)
    assert right is not None and off_topic is not None and 0 <= off_topic < right <= 1
