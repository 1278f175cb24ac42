"""Streamed chat completions (SSE), driven by real clients (openai sync and async, LiteLLM, LangChain)
against the real server on 127.0.0.1 serving the tiny random model.

A seeded request samples the same tokens streamed or not, so every streamed result is compared
with the plain response to the same request: content, tool calls, token ids, logprobs, records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import litellm
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.protocol import Completion
from art_core.engine.torch.engine import TorchEngine
from art_core.models.loading import LoadedModel
from art_core.server.app import ServerHandle, create_app, serve_in_thread
from art_core.server.chat_stream import ChoiceText, StreamTextError, settled_content
from art_core.server.router import ServedModel, StaticRouter

MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        # An enum, so that even a random model's forced call ends well within max_tokens.
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
CONTEXT = 512
TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "token_logprobs", "served_model")


class GenerateOnly:
    """A real engine seen through the plain `Engine` protocol, without `generate_stream` (as VLLMEngine)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        return await self.engine.generate(request)


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[tuple[ServerHandle, TorchEngine]]:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(max_context=CONTEXT))
    router = StaticRouter(
        {
            "tiny@0": ServedModel(engine, tiny_model.tokenizer, None, CONTEXT),
            "whole@0": ServedModel(GenerateOnly(engine), tiny_model.tokenizer, None, CONTEXT),  # type: ignore[arg-type]
        }
    )
    handle = serve_in_thread(create_app(router))
    yield handle, engine
    handle.stop()
    engine.close()


@pytest.fixture
def client(server: tuple[ServerHandle, TorchEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def request(**kwargs: Any) -> dict[str, Any]:
    return {"model": "tiny@0", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, **kwargs}


def extra(choice: Any) -> dict[str, Any]:
    return dict(choice.model_extra or {})


def collect(chunks: Any) -> dict[int, dict[str, Any]]:
    """Per choice index: content, tool calls, finish reason, logprob entries, token fields, chunk count."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            got = out.setdefault(
                choice.index,
                {"content": "", "tool_calls": [], "logprobs": [], "chunks": 0, "finish_reason": None},
            )
            got["chunks"] += 1
            assert got["finish_reason"] is None, "a chunk after the choice's finish_reason"
            if choice.delta.role:
                assert got["chunks"] == 1 and choice.delta.role == "assistant"
            got["content"] += choice.delta.content or ""
            got["tool_calls"] += choice.delta.tool_calls or []
            if choice.logprobs is not None:
                got["logprobs"] += [entry.model_dump() for entry in choice.logprobs.content or []]
            if choice.finish_reason is not None:
                got["finish_reason"] = choice.finish_reason
                got.update({k: extra(choice)[k] for k in TOKEN_FIELDS})
            else:
                assert not set(TOKEN_FIELDS) & set(extra(choice)), "token fields before the last chunk"
    return out


def assert_same_choice(streamed: dict[str, Any], choice: Any) -> None:
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["finish_reason"] == choice.finish_reason
    for key in TOKEN_FIELDS:
        assert streamed[key] == extra(choice)[key], key
    if choice.logprobs is not None:
        assert streamed["logprobs"] == [entry.model_dump() for entry in choice.logprobs.content]


# -- the text a stream may send (pure) ------------------------------------------------------------


def test_settled_content_holds_back_what_later_tokens_may_change() -> None:
    assert settled_content("Hello wor", (), False) == "Hello wor"
    assert settled_content("caf\ufffd", (), False) == "caf"  # half a UTF-8 character
    assert settled_content("Hello EN", ("END",), False) == "Hello "  # may become the stop string
    assert settled_content("Hello E", ("END", "Eh"), False) == "Hello "
    assert settled_content("Hello END more", ("END",), False) == "Hello "
    assert settled_content("  Sure \n<tool", (), True) == "Sure"  # stripped, and the tag may start
    assert settled_content('Sure<tool_call>{"name"', (), True) == "Sure"
    assert settled_content("<tool_call>", (), True) == ""


@pytest.mark.parametrize("step", [1, 2, 5])
def test_choice_text_streams_exactly_the_final_text(tiny_model: LoadedModel, step: int) -> None:
    tok = tiny_model.tokenizer
    text = "Grüße, 世界! 🙂🙂 naïve café STOP after"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(len(ids)))  # characters split across tokens
    for stop, final in (((), text), (("STOP",), text[: text.find("STOP")])):
        choice = ChoiceText(tok, stop, parse_tools=False)
        sent = [choice.feed(ids[i : i + step]) for i in range(0, len(ids), step)]
        assert "\ufffd" not in "".join(sent) and final.startswith("".join(sent))
        assert "".join(sent) + choice.rest(final) == final
    choice = ChoiceText(tok, (), parse_tools=False)
    assert choice.feed(ids) == text
    with pytest.raises(StreamTextError):  # loud, never a silently different text
        choice.rest("something else")


# -- streamed == plain ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_text_and_tokens_equal_the_plain_response(client: openai.OpenAI, seed: int) -> None:
    plain = client.chat.completions.create(**request(seed=seed, logprobs=True, top_logprobs=2))
    chunks = list(
        client.chat.completions.create(**request(seed=seed, logprobs=True, top_logprobs=2), stream=True)
    )
    streamed = collect(chunks)
    assert list(streamed) == [0]
    assert_same_choice(streamed[0], plain.choices[0])
    assert streamed[0]["chunks"] > 3  # really streamed, not one final chunk
    assert len({c.id for c in chunks}) == 1 and all(c.usage is None for c in chunks)


def test_stop_strings_stream_the_same_text(client: openai.OpenAI) -> None:
    full = (
        client.chat.completions.create(**request(temperature=0.0, max_tokens=30)).choices[0].message.content
    )
    assert full
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full)) if full[i : i + 2].strip())
    kwargs = request(temperature=0.0, max_tokens=30, stop=[stop, "never-seen-stop"])
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == full[: full.find(stop)]
    assert_same_choice(collect(client.chat.completions.create(**kwargs, stream=True))[0], plain)


async def test_n_and_usage_with_the_async_client(server: tuple[ServerHandle, TorchEngine]) -> None:
    client = openai.AsyncOpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)
    kwargs = request(n=2, seed=7)
    plain = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    streamed = collect(chunks)
    assert sorted(streamed) == [0, 1]
    for index in (0, 1):
        assert_same_choice(streamed[index], plain.choices[index])
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in body)
    assert last.usage.model_dump() == plain.usage.model_dump()
    await client.close()


def test_forced_tool_call_arrives_as_tool_calls(client: openai.OpenAI) -> None:
    kwargs = request(
        seed=5,
        max_tokens=120,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.tool_calls
    streamed = collect(client.chat.completions.create(**kwargs, stream=True))[0]
    assert_same_choice(streamed, plain)
    assert [
        (c.index, c.type, c.function.name, json.loads(c.function.arguments)) for c in streamed["tool_calls"]
    ] == [
        (i, "function", c.function.name, json.loads(c.function.arguments))
        for i, c in enumerate(plain.message.tool_calls)
    ]
    assert all(c.id and c.id.startswith("call_") for c in streamed["tool_calls"])


def test_json_schema_streams(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kwargs = request(
        seed=3,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    plain = client.chat.completions.create(**kwargs).choices[0]
    streamed = collect(client.chat.completions.create(**kwargs, stream=True))[0]
    assert_same_choice(streamed, plain)
    assert isinstance(json.loads(streamed["content"])["ok"], bool)


def test_an_engine_without_token_streaming_streams_the_whole_completion(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(**request(seed=8, n=2))
    streamed = collect(client.chat.completions.create(**request(seed=8, n=2, model="whole@0"), stream=True))
    for index, choice in enumerate(plain.choices):
        assert streamed[index]["chunks"] == 2  # the role, then everything
        assert streamed[index]["served_model"] == "whole@0"
        assert_same_choice({**streamed[index], "served_model": "tiny@0"}, choice)


# -- errors and disconnects -----------------------------------------------------------------------


def test_errors_before_the_stream_are_json(
    client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine]
) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**request(model="nope"), stream=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            **request(messages=[{"role": "user", "content": "word " * CONTEXT}]), stream=True
        )
    response = httpx.post(
        server[0].url + "/v1/chat/completions", json={**request(), "stream_options": {"include_usage": True}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_engine_failure_mid_stream_is_an_error_event(client: openai.OpenAI, tiny_model: LoadedModel) -> None:
    calls = 0

    def fail_on_the_fifth_forward(*_: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 5:
            handle.remove()
            raise ValueError("injected failure")

    # The output head runs once per forward, whether a step goes through transformers' forward or
    # the engine's own decode step.
    handle = tiny_model.model.lm_head.register_forward_pre_hook(fail_on_the_fifth_forward)
    try:
        stream = client.chat.completions.create(**request(seed=1, max_tokens=40), stream=True)
        seen = []
        with pytest.raises(openai.APIError, match="injected failure"):
            for chunk in stream:
                seen.append(chunk)
        assert seen and collect(seen)[0]["finish_reason"] is None
    finally:
        handle.remove()
    assert client.chat.completions.create(**request(max_tokens=4)).choices[0].message is not None


def test_client_disconnect_stops_decoding(
    client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine], tiny_model: LoadedModel
) -> None:
    engine = server[1]
    max_tokens = 200
    seed = next(
        s
        for s in range(1, 50)
        if client.chat.completions.create(**request(seed=s, max_tokens=max_tokens)).choices[0].finish_reason
        == "length"
    )
    # >= 2 s for 200 tokens: the embedding runs in every forward, the engine's own steps included
    handle = tiny_model.model.get_input_embeddings().register_forward_pre_hook(lambda *_: time.sleep(0.01))
    try:
        before = engine.stats()
        with client.chat.completions.create(
            **request(seed=seed, max_tokens=max_tokens), stream=True
        ) as stream:
            for n_chunks, _ in enumerate(stream, start=1):
                if n_chunks == 3:
                    break
        deadline = time.monotonic() + 30
        while engine.stats().rows == before.rows and time.monotonic() < deadline:
            time.sleep(0.02)
        after = engine.stats()
    finally:
        handle.remove()
    assert after.rows == before.rows + 1 and after.aborted == before.aborted + 1
    assert after.tokens - before.tokens < max_tokens // 2
    assert engine.pending_rows() == 0
    assert client.chat.completions.create(**request(max_tokens=4)).choices[0].message is not None


# -- rollout records ------------------------------------------------------------------------------


def test_rollout_scoped_stream_records_the_same_tokens(server: tuple[ServerHandle, TorchEngine]) -> None:
    url = server[0].url
    records = []
    for rollout_id, stream in (("plain-1", False), ("streamed-1", True)):
        client = openai.OpenAI(base_url=f"{url}/rollouts/{rollout_id}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(**request(seed=11, n=2, logprobs=True), stream=stream)
        if stream:
            assert sorted(collect(response)) == [0, 1]
        (record,) = httpx.delete(f"{url}/rollouts/{rollout_id}").json()["records"]
        records.append(record)
    plain, streamed = records
    for record in records:
        del record["seq"], record["created"]
        for choice in record["choices"]:
            assert choice["turn"].pop("seconds") > 0  # the server's latency, its own per request
    assert streamed == plain and len(plain["choices"]) == 2


def test_header_tagged_stream_is_recorded_before_done(server: tuple[ServerHandle, TorchEngine]) -> None:
    url = server[0].url
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Rollout-Id": "hdr-1"}
    )
    with client.chat.completions.create(**request(seed=2), stream=True) as stream:
        streamed = collect(stream)
    (record,) = httpx.delete(f"{url}/rollouts/hdr-1").json()["records"]
    (choice,) = record["choices"]
    assert choice["turn"]["completion_ids"] == streamed[0]["token_ids"]
    assert choice["message"]["content"] == streamed[0]["content"]


# -- other clients --------------------------------------------------------------------------------


def test_litellm_streaming(client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine]) -> None:
    plain = client.chat.completions.create(**request(seed=4)).choices[0]
    kwargs = request(seed=4)
    kwargs["model"] = "openai/tiny@0"
    chunks = list(litellm.completion(**kwargs, api_base=server[0].url + "/v1", api_key="unused", stream=True))
    assert len(chunks) > 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [plain.finish_reason]
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert rebuilt.choices[0].message.content == plain.message.content


async def test_langchain_chat_openai_streaming(
    client: openai.OpenAI, server: tuple[ServerHandle, TorchEngine]
) -> None:
    plain = client.chat.completions.create(**request(seed=6)).choices[0].message.content
    llm = ChatOpenAI(
        base_url=server[0].url + "/v1",
        api_key=SecretStr("unused"),
        model="tiny@0",
        streaming=True,
        seed=6,
        temperature=1.0,
        max_completion_tokens=24,
        max_retries=0,
    )
    assert llm.invoke(MESSAGES).content == plain
    chunks = [chunk async for chunk in llm.astream(MESSAGES)]
    assert len(chunks) > 3 and "".join(str(c.content) for c in chunks) == plain


@pytest.mark.slow
def test_smollm2_streams_prose_and_tool_calls_like_the_plain_response(smollm2: LoadedModel) -> None:
    """Real text, with tools offered: prose (greedy SmolLM2 answers in prose here) and a required call."""
    engine = TorchEngine(smollm2.model, smollm2.tokenizer)
    router = StaticRouter({"smol": ServedModel(engine, smollm2.tokenizer, None, smollm2.max_context)})
    handle = serve_in_thread(create_app(router))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        kwargs: Any = {
            "model": "smol",
            "messages": [
                {"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}
            ],
            "tools": [WEATHER_TOOL],
            "max_tokens": 60,
            "temperature": 0.0,
        }
        for tool_choice in ("auto", "required"):
            plain = client.chat.completions.create(**kwargs, tool_choice=tool_choice).choices[0]
            streamed = collect(
                client.chat.completions.create(**kwargs, tool_choice=tool_choice, stream=True)
            )[0]
            assert_same_choice(streamed, plain)
            assert "<tool_call>" not in streamed["content"]
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in streamed["tool_calls"]]
            expected = plain.message.tool_calls or []
            assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in expected]
            assert bool(calls) == (tool_choice == "required")
    finally:
        handle.stop()
        engine.close()
