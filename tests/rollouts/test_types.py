"""Trajectory, Turn and TrajectoryGroup: building from ART-style choices, validation, JSON."""

from __future__ import annotations

import math
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import ExceptionInfo, History, Trajectory, Turn

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
}


def server_choice(**overrides: Any) -> dict[str, Any]:
    """A choice as our server returns it: OpenAI fields plus the exact token record."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": "stop",
        "logprobs": None,
        "message": {"role": "assistant", "content": "4"},
        "prompt_token_ids": [1, 2, 3, 4],
        "token_ids": [7, 8, 2],
        "token_logprobs": [-0.5, -0.25, -0.125],
        "served_model": "agent-001@3",
    }
    choice.update(overrides)
    return choice


def tool_choice() -> dict[str, Any]:
    return server_choice(
        finish_reason="tool_calls",
        message={"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        prompt_token_ids=[1, 2, 3],
        token_ids=[50, 51, 52, 53],
        token_logprobs=[-1.0, -0.5, -0.1, 0.0],
    )


PROMPT = [{"role": "system", "content": "add numbers"}, {"role": "user", "content": "2+2?"}]


def test_dict_choice_records_turn_exactly() -> None:
    traj = Trajectory(messages_and_choices=[*PROMPT, server_choice()], reward=1.0)
    assert traj.messages == [*PROMPT, {"role": "assistant", "content": "4"}]
    assert traj.turns == [
        Turn(
            prompt_ids=[1, 2, 3, 4],
            completion_ids=[7, 8, 2],
            logprobs=[-0.5, -0.25, -0.125],
            model="agent-001@3",
            finish_reason="stop",
        )
    ]


def test_openai_choice_object_keeps_extra_fields_and_tool_calls() -> None:
    choice = Choice.model_validate(tool_choice())
    assert choice.model_extra and choice.model_extra["token_ids"] == [50, 51, 52, 53]
    traj = Trajectory(messages_and_choices=[*PROMPT, choice])
    message = traj.messages[-1]
    assert message["role"] == "assistant"
    assert message["content"] is None
    assert message["tool_calls"] == [TOOL_CALL]
    assert "refusal" not in message and "function_call" not in message
    (turn,) = traj.turns
    assert turn.prompt_ids == [1, 2, 3]
    assert turn.completion_ids == [50, 51, 52, 53]
    assert turn.logprobs == [-1.0, -0.5, -0.1, 0.0]
    assert turn.model == "agent-001@3"
    assert turn.finish_reason == "tool_calls"


def test_choice_without_token_fields_keeps_message_but_no_turn() -> None:
    plain = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    )
    traj = Trajectory(messages_and_choices=[*PROMPT, plain])
    assert traj.messages[-1] == {"role": "assistant", "content": "hi"}
    assert traj.turns == []


def test_token_ids_without_logprobs_is_a_clear_error() -> None:
    choice = server_choice()
    del choice["token_logprobs"]
    with pytest.raises(ValueError, match="token_logprobs"):
        Trajectory(messages_and_choices=[choice])


def test_art_style_append_to_messages_and_choices_records_turns() -> None:
    traj = Trajectory(messages_and_choices=list(PROMPT))
    traj.messages_and_choices.append(Choice.model_validate(tool_choice()))
    traj.messages_and_choices.append({"role": "tool", "tool_call_id": "call_1", "content": "3"})
    traj.messages_and_choices.append(server_choice(prompt_token_ids=[1, 2, 3, 50, 51, 52, 53, 9]))
    assert [m["role"] for m in traj.messages_and_choices] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert traj.messages[2]["tool_calls"] == [TOOL_CALL]
    assert [t.completion_ids for t in traj.turns] == [[50, 51, 52, 53], [7, 8, 2]]
    with pytest.raises(ValueError, match="appended"):
        traj.messages_and_choices.insert(0, server_choice())


def test_pydantic_message_object_is_a_message_not_a_choice() -> None:
    choice = Choice.model_validate(server_choice())
    traj = Trajectory(messages_and_choices=[*PROMPT, choice.message])
    assert traj.messages[-1] == {"role": "assistant", "content": "4"}
    assert traj.turns == []


def test_turn_validates_alignment() -> None:
    with pytest.raises(ValidationError, match="2 completion ids but 1 logprobs"):
        Turn(prompt_ids=[1], completion_ids=[2, 3], logprobs=[-0.1])


@pytest.mark.parametrize("reward", [None, math.nan, math.inf, -math.inf])
def test_checked_reward_rejects_missing_and_non_finite(reward: float | None) -> None:
    with pytest.raises(ValueError, match="reward"):
        Trajectory(reward=reward).checked_reward()


def test_checked_reward_returns_finite_reward() -> None:
    assert Trajectory(reward=0.25).checked_reward() == 0.25


def full_trajectory() -> Trajectory:
    traj = Trajectory(
        messages_and_choices=[*PROMPT, Choice.model_validate(tool_choice())],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        reward=0.5,
        metrics={"duration": 1.5, "tool_calls": 1, "solved": True},
        metadata={"scenario": "s1", "seed": 3, "temperature": 1.0, "flag": False, "note": None},
        logs=["started"],
        additional_histories=[
            History(
                messages=[{"role": "user", "content": "judge"}],
                turns=[Turn(prompt_ids=[5], completion_ids=[6], logprobs=[-0.3])],
            )
        ],
    )
    traj.messages.append({"role": "tool", "tool_call_id": "call_1", "content": "3"})
    return traj


def test_trajectory_json_round_trip_preserves_everything() -> None:
    traj = full_trajectory()
    again = Trajectory.model_validate_json(traj.model_dump_json())
    assert again == traj
    assert type(again.metrics["solved"]) is bool and type(again.metrics["tool_calls"]) is int
    assert again.metadata["note"] is None


def test_group_json_round_trip_preserves_everything() -> None:
    try:
        raise KeyError("missing tool")
    except KeyError as exc:
        info = ExceptionInfo.from_exception(exc)
    group = TrajectoryGroup(
        [full_trajectory(), Trajectory(reward=-1.0)],
        exceptions=[info],
        metadata={"scenario": "s1"},
        metrics={"exceptions": 1},
        logs=["note"],
    )
    again = TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert again == group
    assert "pending" not in group.model_dump()
    assert "KeyError" in again.exceptions[0].traceback and "missing tool" in again.exceptions[0].traceback


def test_group_splits_finished_and_pending() -> None:
    async def rollout() -> Trajectory:
        return Trajectory()

    pending = rollout()
    group = TrajectoryGroup([Trajectory(reward=1.0), {"reward": 2.0}, pending])
    assert [t.reward for t in group] == [1.0, 2.0]
    assert group.pending == [pending]
    pending.close()
