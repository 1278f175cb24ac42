"""LiteLLM replies train: the token fields are read where LiteLLM puts them (issue 13, item 8).

The real `litellm` client calls our real server (the tiny model on 127.0.0.1). LiteLLM keeps
`token_ids` at the top of its Choice but moves `prompt_token_ids` and `token_logprobs` into
`provider_specific_fields`; `Trajectory(messages_and_choices=[*messages, choice])` must still
record the exact tokens, and `model.train` must train on them.
"""

from __future__ import annotations

from typing import Any

import litellm
import pytest

from art_core import TrainConfig, Trajectory, TrajectoryGroup
from art_core.model import TrainableModel
from tests.helpers_serving import served_fixture

served = served_fixture("litellm-tokens", project="litellm-tokens", name="agent")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]


async def litellm_choice(model: TrainableModel) -> Any:
    response = await litellm.acompletion(**model.litellm_completion_params(), messages=MESSAGES, max_tokens=5)
    return response.choices[0]


async def test_litellm_choice_has_token_records_and_trains(model: TrainableModel) -> None:
    choices = [await litellm_choice(model) for _ in range(2)]
    moved = choices[0].provider_specific_fields or {}
    assert "prompt_token_ids" in moved and "token_logprobs" in moved  # where LiteLLM puts them today
    trajectories = [
        Trajectory(messages_and_choices=[*MESSAGES, choice], reward=float(k))
        for k, choice in enumerate(choices)
    ]
    for trajectory, choice in zip(trajectories, choices, strict=True):
        (turn,) = trajectory.turns
        fields = {**(choice.provider_specific_fields or {}), "token_ids": choice.token_ids}
        assert turn.prompt_ids == fields["prompt_token_ids"] and turn.completion_ids == fields["token_ids"]
        assert turn.logprobs == pytest.approx(fields["token_logprobs"])
        assert turn.model  # served_model, read from provider_specific_fields
        assert trajectory.messages[-1] == {"role": "assistant", "content": choice.message.content}
        assert not trajectory.untrained_choices
    step = await model.get_step()
    result = await model.train([TrajectoryGroup(trajectories)], config=TrainConfig(learning_rate=1e-4))
    assert result.trained and result.step == step + 1


async def test_add_choice_reads_litellm_fields_too(model: TrainableModel) -> None:
    trajectory = Trajectory(messages=list(MESSAGES))
    trajectory.add_choice(await litellm_choice(model))
    trajectory.messages_and_choices.append(await litellm_choice(model))
    assert len(trajectory.turns) == 2


def other_server_choice() -> dict[str, Any]:
    return {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Apple."}}


async def test_no_token_records_error_names_the_choice_and_fields(model: TrainableModel) -> None:
    trajectories = [
        Trajectory(messages_and_choices=[*MESSAGES, other_server_choice()], reward=float(k)) for k in range(2)
    ]
    assert trajectories[0].turns == [] and "message 2" in trajectories[0].untrained_choices[0]
    with pytest.raises(ValueError) as info:
        await model.train([TrajectoryGroup(trajectories)])
    message = str(info.value)
    assert (
        "the choice added as message 2 carries none of prompt_token_ids, token_ids, token_logprobs" in message
    )
    assert "provider_specific_fields" in message and "points at" not in message


def test_partial_token_fields_are_a_clear_error() -> None:
    choice = {
        **other_server_choice(),
        "token_ids": [1, 2],
        "provider_specific_fields": {"token_logprobs": [0.0, 0.0]},
    }
    with pytest.raises(ValueError, match="has token_ids, token_logprobs but no prompt_token_ids"):
        Trajectory(messages_and_choices=[*MESSAGES, choice])
