"""Constrained decoding: whatever the logits say, the masked samples satisfy the grammar.

Random logits stand in for the worst possible model; real tokenizers (tiny and SmolLM2) are used.
"""

from __future__ import annotations

import json

import pytest
import torch

from art_core.engine.grammar import (
    GrammarError,
    RowConstraint,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)

SCORES = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"enum": ["1", "2"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "explanation": {"type": "string", "maxLength": 12},
                },
                "required": ["trajectory_id", "score", "explanation"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["scores"],
    "additionalProperties": False,
}

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def sample_constrained(constraint: RowConstraint, tokenizer, seed: int, limit: int = 400) -> str:
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    for _ in range(limit):
        logits = torch.randn(constraint.vocab_size, generator=generator) * 3
        constraint.mask_(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token == eos:
            return tokenizer.decode(ids)
        constraint.consume(token)
        ids.append(token)
    raise AssertionError("the grammar never completed")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_answers_respect_bounds_and_required_fields(tiny_model, seed):
    tokenizer, vocab = tiny_model.tokenizer, tiny_model.model.config.vocab_size
    text = sample_constrained(
        RowConstraint(json_schema_grammar(SCORES, "scores"), tokenizer, vocab), tokenizer, seed
    )
    answer = json.loads(text)
    assert len(answer["scores"]) == 2
    for item in answer["scores"]:
        assert set(item) == {"trajectory_id", "score", "explanation"}
        assert item["trajectory_id"] in {"1", "2"}
        assert 0 <= item["score"] <= 1
        assert len(item["explanation"]) <= 12


def test_json_object_gives_an_object(tiny_model):
    tokenizer, vocab = tiny_model.tokenizer, tiny_model.model.config.vocab_size
    constraint = RowConstraint(json_object_grammar(), tokenizer, vocab)
    assert isinstance(json.loads(sample_constrained(constraint, tokenizer, seed=1, limit=2000)), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_is_well_formed(smollm2_tokenizer, choice):
    from art_core.models.tool_format import parse_calls

    vocab = len(smollm2_tokenizer)
    constraint = RowConstraint(tool_call_grammar(WEATHER, choice), smollm2_tokenizer, vocab)
    text = sample_constrained(constraint, smollm2_tokenizer, seed=3)
    content, calls = parse_calls(text)
    assert content is None and len(calls) == 1
    name = calls[0]["function"]["name"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    if isinstance(choice, dict):
        assert name == "get_weather"
    assert name in {"get_weather", "get_time"}
    if name == "get_weather":
        assert set(arguments) == {"city"} and len(arguments["city"]) <= 10


def test_bad_tool_choice_and_schema_are_clear_errors():
    with pytest.raises(GrammarError, match="not among the tools"):
        tool_call_grammar(WEATHER, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GrammarError, match="non-empty"):
        tool_call_grammar([], "required")
    with pytest.raises(GrammarError):
        json_schema_grammar({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
