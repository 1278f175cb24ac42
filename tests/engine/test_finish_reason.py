"""`FinishReason`: a str-valued enum, so the OpenAI JSON and the recorded `Turn` keep their strings."""

from __future__ import annotations

import json

from art_core.engine import FinishReason
from art_core.types import Turn


def test_finish_reasons_are_openais_strings() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "tool_calls"]
    assert FinishReason("length") is FinishReason.LENGTH and FinishReason.STOP == "stop"
    assert json.dumps({"finish_reason": FinishReason.TOOL_CALLS}) == '{"finish_reason": "tool_calls"}'
    assert f"{FinishReason.ABORT}" == "abort"


def test_a_turn_records_the_plain_string() -> None:
    turn = Turn(prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], finish_reason=FinishReason.LENGTH)
    assert json.loads(turn.model_dump_json())["finish_reason"] == "length"
    assert Turn.model_validate_json(turn.model_dump_json()).finish_reason == FinishReason.LENGTH
