"""The OpenAI-compatible server, driven by the real `openai` client over HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from art_core.engine.config import EngineConfig
from art_core.engine.finish_reason import FinishReason
from art_core.engine.protocol import Completion
from art_core.engine.torch.engine import TorchEngine
from art_core.models.chat_template import render_prompt
from art_core.models.loading import LoadedModel
from art_core.rollouts.records import turn_from_choice
from art_core.server.app import ServerHandle, create_app, serve_in_thread
from art_core.server.openai_format import answered_choice, build_choice
from art_core.server.router import ServedModel, StaticRouter

MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[tuple[ServerHandle, TorchEngine]]:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(max_context=256))
    router = StaticRouter({"tiny@0": ServedModel(engine, tiny_model.tokenizer, None, 256)})
    handle = serve_in_thread(create_app(router))
    yield handle, engine
    handle.stop()
    engine.close()


@pytest.fixture
def client(server: tuple[ServerHandle, TorchEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny@0", "messages": MESSAGES, "max_tokens": 16, **kwargs}
    return client.chat.completions.create(**kwargs)


def extra(choice: Any) -> dict[str, Any]:
    return choice.model_extra or {}


def test_chat_completion_carries_the_exact_tokens(client: openai.OpenAI, tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    response = chat(client, temperature=0.0)
    (choice,) = response.choices
    fields = extra(choice)
    assert fields["prompt_token_ids"] == render_prompt(tok, MESSAGES)
    assert fields["served_model"] == "tiny@0" and response.model == "tiny@0"
    ids = fields["token_ids"]
    assert len(ids) == len(fields["token_logprobs"]) == response.usage.completion_tokens
    assert all(lp <= 0 for lp in fields["token_logprobs"])
    assert response.usage.prompt_tokens == len(fields["prompt_token_ids"])
    if choice.finish_reason == "stop":
        assert ids[-1] == tok.eos_token_id
        ids = ids[:-1]
    else:
        assert choice.finish_reason == "length" and len(ids) == 16
    assert choice.message.content == tok.decode(ids, skip_special_tokens=False)
    assert choice.logprobs is None and choice.message.tool_calls is None
    _, turn = turn_from_choice(choice)  # what the trainer reads back
    assert turn is not None and turn.completion_ids == fields["token_ids"] and turn.model == "tiny@0"


def test_logprobs_shape(client: openai.OpenAI) -> None:
    choice = chat(client, logprobs=True, top_logprobs=3, seed=1).choices[0]
    content = choice.logprobs.content
    assert [c.logprob for c in content] == extra(choice)["token_logprobs"]
    assert len(content) == len(extra(choice)["token_ids"])
    for entry in content:
        assert len(entry.top_logprobs) == 3 and isinstance(entry.bytes, list)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


def test_n_seed_and_stop(client: openai.OpenAI) -> None:
    response = chat(client, n=3, seed=42, temperature=1.0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({tuple(extra(c)["token_ids"]) for c in response.choices}) > 1
    again = chat(client, n=3, seed=42, temperature=1.0)
    assert [extra(c)["token_ids"] for c in again.choices] == [extra(c)["token_ids"] for c in response.choices]

    full = chat(client, temperature=0.0, max_tokens=30).choices[0].message.content
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full)) if full[i : i + 2].strip())
    stopped = chat(client, temperature=0.0, max_tokens=30, stop=[stop, "never-seen-stop"]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == full[: full.find(stop)]


def test_models_and_health(client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine]) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny@0"]
    assert httpx.get(server[0].url + "/health").json() == {"status": "ok"}


def _assert_openai_error(exc: openai.APIStatusError, status: int) -> None:
    assert exc.status_code == status
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_errors_in_openai_shape(client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine]) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        chat(client, model="nope")
    _assert_openai_error(not_found.value, 404)
    bad: list[dict[str, Any]] = [
        {"temperature": -1},
        {"n": 0},
        {"top_p": 0},
        {"messages": []},
        {"stream_options": {"include_usage": True}},  # only with stream=true
        {"tool_choice": "required"},  # no tools to choose from
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},  # no schema
        {"response_format": {"type": "yaml"}},
        {"top_logprobs": 2},
        {"messages": [{"role": "user", "content": "word " * 300}]},
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as exc:
            chat(client, **kwargs)
        _assert_openai_error(exc.value, 400)
    missing = httpx.post(server[0].url + "/v1/chat/completions", json={"model": "tiny@0"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"


HARMLESS_FIELDS: Any = {
    "user": "u-1",
    "metadata": {"run": "r"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": False,  # LangChain's with_structured_output(method="function_calling")
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "prediction": None,
}


def test_fields_with_no_effect_are_accepted(client: openai.OpenAI) -> None:
    (choice,) = chat(client, max_tokens=2, **HARMLESS_FIELDS).choices
    assert len(extra(choice)["token_ids"]) <= 2


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"5": 100}}, "logit_bias"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),  # unknown: refused, not ignored
        ({"extra_body": {"ignore_eos": True}, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ],
)
def test_fields_the_server_does_not_implement_are_a_400_naming_them(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, **kwargs)
    _assert_openai_error(exc.value, 400)
    error = exc.value.response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_ignore_eos_samples_exactly_max_tokens(client: openai.OpenAI, tiny_model: LoadedModel) -> None:
    eos = tiny_model.tokenizer.eos_token_id
    sampled: Any = {"temperature": 1.0, "seed": 476, "max_tokens": 16}  # this seed samples eos 6th
    stopped = chat(client, **sampled)
    early = extra(stopped.choices[0])["token_ids"]
    assert stopped.choices[0].finish_reason == "stop" and len(early) < 16 and early[-1] == eos

    full = chat(client, **sampled, extra_body={"ignore_eos": True})
    (choice,) = full.choices
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 16
    assert extra(choice)["token_ids"][: len(early)] == early  # the same row, sampled on past its eos
    # Explicit stops still apply: stop at the end-of-turn text and the answer is the one that stopped.
    eot = tiny_model.tokenizer.decode([eos])
    cut = chat(client, **sampled, stop=[eot], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == stopped.choices[0].message.content


def test_engine_failure_is_a_500(client: openai.OpenAI, tiny_model: LoadedModel) -> None:
    def fail_once(*_: Any) -> None:
        handle.remove()
        raise ValueError("injected failure")  # a ValueError inside the engine is still the server's fault

    # on the embedding: every forward runs it, transformers' and the engine's own steps alike
    handle = tiny_model.model.get_input_embeddings().register_forward_pre_hook(fail_once)
    with pytest.raises(openai.InternalServerError) as exc:
        chat(client)
    _assert_openai_error(exc.value, 500)
    assert "injected failure" in exc.value.response.json()["error"]["message"]
    assert chat(client).choices[0].message.content is not None


def test_api_key(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer)
    router = StaticRouter({"m": ServedModel(engine, tiny_model.tokenizer, None, 256)})
    handle = serve_in_thread(create_app(router, api_key="s3cret"))
    try:
        wrong = openai.OpenAI(base_url=handle.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            wrong.models.list()
        _assert_openai_error(exc.value, 401)
        assert httpx.get(handle.url + "/health").status_code == 401
        right = openai.OpenAI(base_url=handle.url + "/v1", api_key="s3cret", max_retries=0)
        assert right.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices
    finally:
        handle.stop()
        engine.close()


async def test_concurrent_requests_are_batched(server: tuple[ServerHandle, TorchEngine]) -> None:
    handle, engine = server
    client = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
    before = engine.stats().batches
    messages: Any = [[{"role": "user", "content": f"Count to {i}."}] for i in range(16)]
    responses = await asyncio.gather(
        *[
            client.chat.completions.create(model="tiny@0", messages=m, max_tokens=8, temperature=0.0)
            for m in messages
        ]
    )
    assert len(responses) == 16 and all(r.choices[0].message.content is not None for r in responses)
    assert engine.stats().batches - before < 16
    alone = await client.chat.completions.create(
        model="tiny@0", messages=messages[5], max_tokens=8, temperature=0.0
    )
    assert extra(alone.choices[0])["token_ids"] == extra(responses[5].choices[0])["token_ids"]
    await client.close()


def test_build_choice_parses_tool_calls(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    completion = Completion(ids, [-0.5] * len(ids), [[] for _ in ids], text, "stop")
    choice = build_choice(0, completion, tok, prompt_ids=[1, 2], served_model="m@1", parse_tools=True)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert choice["message"]["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert (
        choice["token_ids"] == ids
        and choice["prompt_token_ids"] == [1, 2]
        and choice["served_model"] == "m@1"
    )
    plain = build_choice(0, completion, tok, prompt_ids=[1, 2], served_model="m@1", with_logprobs=True)
    assert plain["message"] == {"role": "assistant", "content": text} and plain["finish_reason"] == "stop"
    assert [e["logprob"] for e in plain["logprobs"]["content"]] == [-0.5] * len(ids)
    assert b"".join(bytes(e["bytes"]) for e in plain["logprobs"]["content"][:-1]).decode() == text


@pytest.mark.parametrize("parse_tools", [True, False])
def test_the_recorded_turn_comes_from_the_completion_and_matches_the_json(
    tiny_model: LoadedModel, parse_tools: bool
) -> None:
    tok = tiny_model.tokenizer
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    completion = Completion(ids, [-0.25] * len(ids), [[] for _ in ids], text, FinishReason.LENGTH)
    answered = answered_choice(
        3, completion, tok, prompt_ids=[7, 8], served_model="m@2", parse_tools=parse_tools
    )
    turn = answered.turn
    assert (turn.prompt_ids, turn.completion_ids, turn.logprobs, turn.model) == (
        [7, 8],
        ids,
        completion.logprobs,
        "m@2",
    )
    assert turn.finish_reason == ("tool_calls" if parse_tools else "length")
    assert answered.body["message"] is answered.message and answered.body["index"] == 3
    assert turn_from_choice(json.loads(json.dumps(answered.body))) == (
        answered.message,
        turn,
    )  # what a client reads


@pytest.mark.slow
def test_smollm2_tool_call_round_trip(smollm2: LoadedModel) -> None:
    engine = TorchEngine(smollm2.model, smollm2.tokenizer)
    router = StaticRouter({"smol": ServedModel(engine, smollm2.tokenizer, None, smollm2.max_context)})
    handle = serve_in_thread(create_app(router))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}],
            tools=[WEATHER_TOOL],
            max_tokens=60,
            temperature=0.0,
        )
        choice = response.choices[0]
        fields = extra(choice)
        assert fields["prompt_token_ids"] == render_prompt(
            smollm2.tokenizer, response_messages(), [WEATHER_TOOL]
        )
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.type == "function" and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    finally:
        handle.stop()
        engine.close()


def response_messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]


SCORE_SCHEMA = {
    "type": "object",
    "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "label": {"enum": ["good", "bad"]},
    },
    "required": ["score", "label"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_response_format_is_enforced_even_on_a_random_model(
    client: openai.OpenAI, seed: int
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "score", "schema": SCORE_SCHEMA, "strict": True},
    }
    reply = chat(client, response_format=response_format, max_tokens=200, seed=seed, temperature=1.0)
    answer = json.loads(reply.choices[0].message.content)
    assert (
        set(answer) == {"score", "label"} and 0 <= answer["score"] <= 1 and answer["label"] in {"good", "bad"}
    )
    assert reply.choices[0].finish_reason == "stop"
    # The token record is still the model's own: the trainer scores exactly these ids.
    assert len(extra(reply.choices[0])["token_ids"]) == len(extra(reply.choices[0])["token_logprobs"])


@pytest.mark.slow
def test_required_tool_choice_returns_a_well_formed_tool_call(smollm2: LoadedModel) -> None:
    """With tool_choice "required" even a 135M model that usually answers in prose must call the tool."""
    engine = TorchEngine(smollm2.model, smollm2.tokenizer)
    router = StaticRouter({"smol": ServedModel(engine, smollm2.tokenizer, None, smollm2.max_context)})
    handle = serve_in_thread(create_app(router))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": "Is it warm in Paris today?"}],
                tools=[WEATHER_TOOL],
                tool_choice=tool_choice,  # type: ignore[arg-type]
                max_tokens=60,
                temperature=0.0,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert isinstance(json.loads(call.function.arguments)["city"], str)
    finally:
        handle.stop()
        engine.close()
