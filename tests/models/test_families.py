"""The family matrix: a tiny random model of each architecture ART users train, end to end.

For Llama 3.1, Qwen2.5, Qwen3, Gemma 3 (sliding-window and global layers), Mistral v0.3, Phi-3 and
Qwen3-MoE (`tests.helpers_families`), each built locally with its family's chat template, served
by our real server through a LocalBackend and driven by the real openai client on 127.0.0.1:
plain, streamed, forced tool calls (plain and streamed) and a JSON-schema response_format; a
two-turn tool-using rollout captured with exact tokens; the engine's sampled log-probs against the
trainer's step-0 recomputation (float32 serving, tolerance from `tests.tolerances`); one GRPO step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from art_core.backends import LocalBackend
from art_core.engine.config import EngineConfig
from art_core.engine.torch.decode_step import supports_decode_step
from art_core.model import TrainableModel
from art_core.models.chat_template import tool_format_of
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.training.batch import collate, prepare_batch
from art_core.training.config import TrainConfig
from art_core.training.packed_forward import supports_packed_forward
from art_core.training.trainer import decoder_and_head
from integrations import rollout
from tests.helpers_families import FAMILIES, Family, build_family
from tests.tolerances import model_tolerance

ASYNC = pytest.mark.asyncio(loop_scope="module")
CITIES = ["Paris", "Tokyo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
Hosted = tuple[Family, LocalBackend, TrainableModel]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=FAMILIES, ids=lambda f: f.name)
async def hosted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Hosted]:
    family: Family = request.param
    folder = build_family(family, tmp_path_factory.mktemp(f"model-{family.name}") / family.name)
    # float32 serving: the engine's log-probs and the trainer's differ by float32 rounding only.
    backend = LocalBackend(
        tmp_path_factory.mktemp(family.name), engine_config=EngineConfig(serve_dtype=torch.float32)
    )
    model = TrainableModel(project="families", name=family.name, base_model=str(folder))
    await model.register(backend)
    yield family, backend, model
    await backend.close()


def _hosted_model(backend: LocalBackend, name: str) -> Any:
    return backend.service.get(name)


def extra(choice: Any) -> dict[str, Any]:
    return dict(choice.model_extra or {})


@ASYNC
async def test_detected_format_and_paths(hosted: Hosted) -> None:
    family, backend, model = hosted
    host = _hosted_model(backend, model.name)
    fmt = tool_format_of(host.loaded.tokenizer)
    assert (fmt.name, fmt.in_content) == (family.tool_format, family.in_content)
    assert host.loaded.tokenizer.eos_token == fmt.end_of_turn
    decoder, _ = decoder_and_head(host.trainer.model)
    assert supports_packed_forward(decoder) == family.fast
    assert supports_decode_step(host.loaded.model) == family.fast


@ASYNC
async def test_plain_and_streamed(hosted: Hosted) -> None:
    _, _, model = hosted
    client = model.openai_client()
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    plain = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, seed=3)
    fields = extra(plain.choices[0])
    assert 0 < len(fields["token_ids"]) == len(fields["token_logprobs"]) <= 8
    stream = await client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=8, seed=3, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == (plain.choices[0].message.content or "")


@ASYNC
@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_call_is_parsed(hosted: Hosted, stream: bool) -> None:
    _, _, model = hosted
    client = model.openai_client()
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: Any = dict(
            model=model.name, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=40
        )
        if not stream:
            call = (await client.chat.completions.create(**kwargs)).choices[0].message.tool_calls[0]
        else:
            chunks = await client.chat.completions.create(**kwargs, stream=True)
            deltas = [c.choices[0].delta async for c in chunks if c.choices]
            calls = [call for d in deltas for call in (d.tool_calls or [])]
            assert len(calls) == 1 and not "".join(d.content or "" for d in deltas).strip()
            call = calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in CITIES


@ASYNC
async def test_json_schema_response_format(hosted: Hosted) -> None:
    _, _, model = hosted
    reply = await model.openai_client().chat.completions.create(
        model=model.name,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        max_tokens=20,
    )
    assert json.loads(reply.choices[0].message.content or "")["answer"] in ("yes", "no")


async def _tool_rollout(model: TrainableModel, reward: float) -> tuple[Trajectory, list[Any]]:
    """Two turns: a forced tool call, its result, then a free answer; the captured trajectory."""
    client = model.openai_client()
    messages: list[Any] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Paris?"}]
    choices = []
    async with rollout(model) as scope:
        first = await client.chat.completions.create(
            model=model.name, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=40
        )
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = await client.chat.completions.create(
            model=model.name, messages=messages, tools=[WEATHER], max_tokens=6
        )
        choices = [first.choices[0], second.choices[0]]
        scope.reward = reward
    return scope.trajectory, choices


@ASYNC
async def test_tool_rollout_is_captured_exactly_and_trains(hosted: Hosted) -> None:
    _, backend, model = hosted
    captured = [await _tool_rollout(model, reward) for reward in (1.0, 0.0)]
    for trajectory, choices in captured:
        turns = trajectory.turns + [t for h in trajectory.additional_histories for t in h.turns]
        assert len(turns) == 2
        for turn, choice in zip(sorted(turns, key=lambda t: len(t.prompt_ids)), choices, strict=True):
            fields = extra(choice)
            assert (turn.prompt_ids, turn.completion_ids) == (fields["prompt_token_ids"], fields["token_ids"])
            assert turn.logprobs == pytest.approx(fields["token_logprobs"], abs=0)
    group = TrajectoryGroup([trajectory for trajectory, _ in captured])
    host = _hosted_model(backend, model.name)
    _assert_engine_logprobs_match_trainer(host, group)
    result = await model.train([group], config=TrainConfig(learning_rate=1e-3))
    assert result.trained and result.step == 1, result.warnings


def _assert_engine_logprobs_match_trainer(host: Any, group: TrajectoryGroup) -> None:
    prepared = prepare_batch(
        [group],
        scale_rewards=True,
        max_context=host.engine.max_context,
        vocab_size=len(host.loaded.tokenizer),
    )
    assert prepared.examples, prepared.warnings
    batch = collate(prepared.examples, host.trainer.pad_id)
    ours = host.trainer.compute_logprobs(prepared.examples).cpu()
    known = (batch["mask"] > 0) & ~torch.isnan(batch["engine_logprobs"])
    assert known.sum() >= 2
    engine = batch["engine_logprobs"][known]
    bound = model_tolerance(host.loaded.model, torch.float32, scale=float(engine.abs().max()))
    worst = float((ours[known] - engine).abs().max())
    assert worst <= bound, f"engine vs trainer log-probs differ by {worst:.3g} > {bound:.3g}"
