"""Exact-token sequences: merging turns by prefix, masks on sampled tokens only, additional histories."""

from __future__ import annotations

import math
from typing import Any

import pytest

from art_core.models.loading import LoadedModel
from art_core.rollouts.records import History, Trajectory, Turn
from art_core.training.sequences import (
    NoTrainableTokensError,
    TokenSequence,
    trajectory_sequences,
    turns_to_sequences,
)


def turn(prompt: list[int], completion: list[int]) -> Turn:
    return Turn(
        prompt_ids=prompt, completion_ids=completion, logprobs=[-0.5 - i for i in range(len(completion))]
    )


def sampled_positions(seq: TokenSequence) -> list[int]:
    return [i for i, m in enumerate(seq.mask) if m]


def assert_logprobs_on_mask(seq: TokenSequence) -> None:
    for m, lp in zip(seq.mask, seq.logprobs, strict=True):
        assert math.isnan(lp) != bool(m)


# ------------------------------------------------------------------------------------------ hand-built ids


def test_perfect_prefix_merges_three_turns_into_one_sequence() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn([1, 2, 3, 10, 11, 4, 5], [12])  # + tool result 4 5
    t3 = turn([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15])  # + user message 6
    [seq] = turns_to_sequences([t1, t2, t3])
    assert seq.token_ids == (1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15)
    assert seq.mask == (0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1)
    assert [seq.logprobs[i] for i in sampled_positions(seq)] == [-0.5, -1.5, -0.5, -0.5, -1.5, -2.5]
    assert_logprobs_on_mask(seq)
    assert seq.num_trainable == 6


def test_broken_prefix_starts_a_new_sequence() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn([1, 2, 3, 10, 99, 4], [12])  # the assistant message was re-rendered differently
    first, second = turns_to_sequences([t1, t2])
    assert first.token_ids == (1, 2, 3, 10, 11) and first.mask == (0, 0, 0, 1, 1)
    assert second.token_ids == (1, 2, 3, 10, 99, 4, 12) and second.mask == (0, 0, 0, 0, 0, 0, 1)


def test_shorter_prompt_does_not_merge() -> None:
    t1 = turn([1, 2, 3], [10, 11])
    t2 = turn([1, 2, 3, 10], [12])  # a prefix of the sequence, not an extension of it
    assert len(turns_to_sequences([t1, t2])) == 2


def test_additional_histories_become_extra_sequences() -> None:
    trajectory = Trajectory(
        turns=[turn([1, 2], [3]), turn([1, 2, 3, 4], [5])],
        additional_histories=[History(turns=[turn([7, 8], [9])]), History(turns=[turn([7], [6, 6])])],
    )
    sequences = trajectory_sequences(trajectory)
    assert [s.token_ids for s in sequences] == [(1, 2, 3, 4, 5), (7, 8, 9), (7, 6, 6)]
    assert [s.mask for s in sequences] == [(0, 0, 1, 0, 1), (0, 0, 1), (0, 1, 1)]


def test_empty_completion_turn_merges_and_trains_nothing_itself() -> None:
    t1 = turn([1, 2], [])
    t2 = turn([1, 2, 3], [4, 5])
    [seq] = turns_to_sequences([t1, t2])
    assert seq.token_ids == (1, 2, 3, 4, 5) and seq.mask == (0, 0, 0, 1, 1)


def test_only_empty_completions_is_no_trainable_tokens() -> None:
    assert turns_to_sequences([turn([1, 2], [])])[0].num_trainable == 0
    with pytest.raises(NoTrainableTokensError, match="empty"):
        trajectory_sequences(Trajectory(turns=[turn([1, 2], [])]))


def test_trajectory_without_turns_explains_the_likely_cause() -> None:
    trajectory = Trajectory(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )
    with pytest.raises(NoTrainableTokensError, match="openai_client") as info:
        trajectory_sequences(trajectory)
    assert "message dicts" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_history_sequences_without_trainable_tokens_are_dropped() -> None:
    trajectory = Trajectory(turns=[turn([1], [2])], additional_histories=[History(turns=[turn([3], [])])])
    assert [s.token_ids for s in trajectory_sequences(trajectory)] == [(1, 2)]


def test_token_sequence_validates_lengths() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        TokenSequence((1, 2), (0,), (math.nan, math.nan))
    with pytest.raises(ValueError, match="0 and 1"):
        TokenSequence((1,), (2,), (0.0,))


# ------------------------------------------------------------------- rendered with a real chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def render(tiny_model: LoadedModel, messages: list[dict[str, Any]]) -> list[int]:
    ids = tiny_model.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return list(tiny_model.tokenizer.encode(ids, add_special_tokens=False))


def sample(tiny_model: LoadedModel, text: str) -> list[int]:
    """What the engine would have sampled: the text's tokens followed by the end-of-turn token."""
    return [*tiny_model.tokenizer.encode(text, add_special_tokens=False), tiny_model.tokenizer.eos_token_id]


def tool_call(arguments: Any, call_id: str = "c1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}


def test_rendered_tool_round_trip_merges_into_one_sequence(tiny_model: LoadedModel) -> None:
    call_1 = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call_2 = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 4}}\n</tool_call>'
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3 + 4?"}]
    p1 = render(tiny_model, messages)
    c1 = sample(tiny_model, call_1)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [tool_call('{"a": 2, "b": 3}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    p2 = render(tiny_model, messages)
    c2 = sample(tiny_model, call_2)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [tool_call('{"a": 5, "b": 4}', "c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "9"},
    ]
    p3 = render(tiny_model, messages)
    c3 = sample(tiny_model, "The answer is 9.")
    [seq] = turns_to_sequences([turn(p1, c1), turn(p2, c2), turn(p3, c3)])
    assert list(seq.token_ids) == p3 + c3
    sampled = [seq.token_ids[i] for i in sampled_positions(seq)]
    assert sampled == c1 + c2 + c3
    decoded = tiny_model.tokenizer.decode([t for t, m in zip(seq.token_ids, seq.mask, strict=True) if not m])
    assert "<tool_response>\n5\n</tool_response>" in decoded and "What is 2 + 3 + 4?" in decoded
    assert_logprobs_on_mask(seq)


def test_rendered_reformatted_tool_call_breaks_the_prefix(tiny_model: LoadedModel) -> None:
    # The model sampled compact JSON; the message stores parsed arguments, which the template
    # re-renders with spaces. The next prompt no longer extends the sampled tokens.
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    p1 = render(tiny_model, messages)
    c1 = sample(tiny_model, '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>')
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [tool_call({"a": 2, "b": 3})]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    p2 = render(tiny_model, messages)
    c2 = sample(tiny_model, "It is 5.")
    first, second = turns_to_sequences([turn(p1, c1), turn(p2, c2)])
    assert list(first.token_ids) == p1 + c1 and sampled_positions(first) == list(range(len(p1), len(p1 + c1)))
    # The re-rendered call is context in the second sequence: only "It is 5." is trained there.
    assert list(second.token_ids) == p2 + c2
    assert [second.token_ids[i] for i in sampled_positions(second)] == c2
