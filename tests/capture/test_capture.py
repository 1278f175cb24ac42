"""Capture of LLM calls into trajectories: every door, against our real server (tiny model, LocalBackend).

Each door is driven by its real client (openai async and sync, litellm, httpx) over HTTP on
127.0.0.1; the trajectory a scope yields must hold exactly the tokens the responses carried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import litellm
import openai
import pytest

from art_core.backends import LocalBackend
from art_core.capture import (
    ROLLOUT_ID_HEADER,
    CallRecord,
    RecordedChoice,
    RecorderConfig,
    RolloutRecorder,
    trajectory_from_records,
    validate_rollout_id,
)
from art_core.model import TrainableModel
from art_core.rollouts.records import Trajectory, Turn
from art_core.training.sequences import trajectory_sequences
from integrations import NothingCapturedError, current_scope, rollout, rollout_scope
from integrations.litellm import acompletion as scoped_acompletion
from integrations.litellm import scoped_params
from integrations.openai import patch_client
from tests.helpers_serving import served_fixture

ASYNC = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 6


served = served_fixture("capture", project="capture", name="agent")


@pytest.fixture
def backend(served: tuple[LocalBackend, TrainableModel]) -> LocalBackend:
    return served[0]


def token_fields(choice: Any) -> dict[str, Any]:
    """Our server's token fields of an openai or litellm choice, or of a choice dict."""
    if isinstance(choice, dict):
        return choice
    extra = dict(choice.model_extra or {})
    extra.update(getattr(choice, "provider_specific_fields", None) or {})
    return extra


def assert_turn_matches(turn: Turn, choice: Any) -> None:
    fields = token_fields(choice)
    assert turn.prompt_ids == fields["prompt_token_ids"]
    assert turn.completion_ids == fields["token_ids"]
    assert turn.logprobs == pytest.approx(fields["token_logprobs"])


def reply(choice: Any) -> dict[str, Any]:
    message = choice["message"] if isinstance(choice, dict) else choice.message.model_dump(exclude_none=True)
    return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}


# -- doors ----------------------------------------------------------------------------------------


@ASYNC
async def test_openai_async_door_captures_multi_turn_exact_tokens(model: TrainableModel) -> None:
    client = model.openai_client()
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}]
    choices = []
    before = time.time()
    async with rollout(model) as scope:
        for follow_up in ("second", "third"):
            response = await client.chat.completions.create(
                model=model.name, messages=messages, max_tokens=MAX_TOKENS
            )
            choices.append(response.choices[0])
            messages += [reply(response.choices[0]), {"role": "user", "content": follow_up}]
        scope.reward = 0.5
    trajectory = scope.trajectory
    assert len(trajectory.turns) == 2 and not trajectory.additional_histories
    # it started with the scope, before its calls: its step's `time/rollout_s` counts them
    assert before <= trajectory.start_time == scope.started < time.time()
    for turn, choice in zip(trajectory.turns, choices, strict=True):
        assert_turn_matches(turn, choice)
        assert turn.model == model.name
    # The conversation of the last call plus its reply; the final follow-up was never sent.
    assert trajectory.messages == messages[:-1] and messages[-2] == reply(choices[-1])
    assert trajectory.reward == 0.5 and trajectory.metadata["rollout_id"] == scope.id
    sequences = trajectory_sequences(trajectory)
    first, second = trajectory.turns
    continues = second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == [
        *first.prompt_ids,
        *first.completion_ids,
    ]
    assert len(sequences) == (1 if continues else 2)


@ASYNC
async def test_a_lone_surrogate_in_a_message_is_captured_as_sent(model: TrainableModel) -> None:
    # The server writes it back as a \ud800 escape; the scope must read that (was a JSON error).
    # (The openai client cannot send one; a raw HTTP client can, as a JSON escape.)
    messages: list[Any] = [{"role": "user", "content": "hi", "name": "x\ud800"}]
    body = {"model": model.name, "messages": messages, "max_tokens": MAX_TOKENS}
    async with rollout(model) as scope, httpx.AsyncClient() as http:
        response = await http.post(
            f"{scope.server_url}/rollouts/{scope.id}/v1/chat/completions",
            content=json.dumps(body),  # ensure_ascii: the surrogate travels as an escape
            headers={
                "Authorization": f"Bearer {model.inference_api_key}",
                "Content-Type": "application/json",
            },
        )
        assert response.status_code == 200, response.text
    assert scope.records[0].messages[0]["name"] == "x\ud800"


async def test_openai_sync_door_in_a_thread(model: TrainableModel) -> None:
    client = model.sync_openai_client()

    def agent() -> Any:
        return client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "sync"}], max_tokens=MAX_TOKENS
        )

    async with rollout(model) as scope:
        response = await asyncio.to_thread(agent)
    (turn,) = scope.trajectory.turns
    assert_turn_matches(turn, response.choices[0])
    assert scope.trajectory.messages[-1] == reply(response.choices[0])


@ASYNC
async def test_litellm_door_acompletion_and_completion(model: TrainableModel) -> None:
    async with rollout(model) as scope:
        params = model.litellm_completion_params()
        assert params["api_base"] == scope.base_url
        messages: list[Any] = [{"role": "user", "content": "litellm"}]
        first = await litellm.acompletion(**params, messages=messages, max_tokens=MAX_TOKENS)
        messages += [reply(first.choices[0]), {"role": "user", "content": "again"}]
        second = await asyncio.to_thread(
            lambda: litellm.completion(**params, messages=messages, max_tokens=MAX_TOKENS)
        )
    assert model.litellm_completion_params()["api_base"] == model.inference_base_url
    trajectory = scope.trajectory
    assert len(trajectory.turns) == 2
    assert_turn_matches(trajectory.turns[0], first.choices[0])
    assert_turn_matches(trajectory.turns[1], second.choices[0])
    assert trajectory.messages[-1]["content"] == second.choices[0].message.content


@ASYNC
async def test_streamed_calls_are_captured_like_plain_ones(model: TrainableModel) -> None:
    """openai (header door) and LiteLLM (scoped URL door) with stream=True: the records, hence the
    trajectory, hold the same tokens as the plain call with the same seed, and the reply a client
    rebuilt from the chunks continues the conversation (one history, two turns)."""
    client = model.openai_client()
    messages: list[Any] = [{"role": "user", "content": "stream"}]
    kwargs: Any = {"model": model.name, "max_tokens": MAX_TOKENS, "seed": 5, "temperature": 1.0}
    async with rollout(model) as plain_scope:
        plain = await client.chat.completions.create(messages=messages, **kwargs)
    async with rollout(model) as scope:
        chunks = [
            c async for c in await client.chat.completions.create(messages=messages, stream=True, **kwargs)
        ]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
        params = {**model.litellm_completion_params(), "max_tokens": MAX_TOKENS}
        pieces = [c async for c in await litellm.acompletion(**params, messages=messages, stream=True)]
    assert content == plain.choices[0].message.content
    trajectory = scope.trajectory
    assert len(trajectory.turns) == 2 and not trajectory.additional_histories
    first, second = trajectory.turns
    assert first.completion_ids == plain_scope.trajectory.turns[0].completion_ids
    assert_turn_matches(first, plain.choices[0])
    assert_turn_matches(first, chunks[-1].choices[0])  # the last chunk carries the token fields
    assert trajectory.messages[:3] == messages  # as sent, the streamed reply included
    assert trajectory.messages[-1]["content"] == "".join(p.choices[0].delta.content or "" for p in pieces)
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids


@ASYNC
async def test_litellm_params_built_before_the_scope(model: TrainableModel) -> None:
    params = model.litellm_completion_params()  # unscoped api_base
    async with rollout(model) as scope:
        response = await litellm.acompletion(
            **scoped_params(params), messages=[{"role": "user", "content": "a"}], max_tokens=MAX_TOKENS
        )
        wrapped = await scoped_acompletion(
            **params, messages=[{"role": "user", "content": "b"}], max_tokens=3
        )
    trajectory = scope.trajectory
    assert len(trajectory.turns) + sum(len(h.turns) for h in trajectory.additional_histories) == 2
    turns = {tuple(t.completion_ids) for t in [*trajectory.turns, *trajectory.additional_histories[0].turns]}
    assert turns == {tuple(token_fields(c.choices[0])["token_ids"]) for c in (response, wrapped)}
    with pytest.raises(NothingCapturedError):
        async with rollout(model):
            await litellm.acompletion(**params, messages=[{"role": "user", "content": "c"}], max_tokens=2)


@ASYNC
async def test_plain_httpx_to_the_scoped_base_url(model: TrainableModel) -> None:
    auth = {"Authorization": f"Bearer {model.inference_api_key}"}
    user = {"role": "user", "content": "httpx"}
    body = {"model": model.name, "messages": [user], "max_tokens": MAX_TOKENS}
    async with rollout(model) as scope:
        # No header and no contextvar magic: the URL alone names the rollout (any language works).
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{scope.base_url}/chat/completions", json=body, headers=auth)
            models = await http.get(f"{scope.base_url}/models", headers=auth)
    assert response.status_code == 200 and models.status_code == 200
    assert model.name in [m["id"] for m in models.json()["data"]]
    choice = response.json()["choices"][0]
    (turn,) = scope.trajectory.turns
    assert_turn_matches(turn, choice)
    assert scope.trajectory.messages == [user, reply(choice)]


@ASYNC
async def test_header_on_the_plain_route_and_patch_client(model: TrainableModel) -> None:
    own = openai.AsyncOpenAI(
        base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0
    )
    auth = {"Authorization": f"Bearer {model.inference_api_key}"}
    body = {"model": model.name, "messages": [{"role": "user", "content": "header"}], "max_tokens": 3}
    with pytest.raises(NothingCapturedError, match="patch_client"):
        async with rollout(model):
            await own.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
    assert patch_client(own) is own and patch_client(own) is own  # idempotent
    async with rollout(model) as scope:
        patched = await own.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "y"}], max_tokens=2
        )
        async with httpx.AsyncClient() as http:
            explicit = await http.post(
                f"{model.inference_base_url}/chat/completions", json=body, headers={**auth, **scope.headers}
            )
    own_sync = patch_client(
        openai.OpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    )
    async with rollout(model) as sync_scope:
        in_thread = await asyncio.to_thread(
            lambda: own_sync.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "z"}], max_tokens=2
            )
        )
    recorded = {tuple(r.choices[0].turn.completion_ids) for r in scope.records}
    assert recorded == {
        tuple(token_fields(patched.choices[0])["token_ids"]),
        tuple(explicit.json()["choices"][0]["token_ids"]),
    }
    assert_turn_matches(sync_scope.trajectory.turns[0], in_thread.choices[0])
    await own.close()
    own_sync.close()


# -- failures and the server's memory -------------------------------------------------------------


@ASYNC
async def test_nothing_captured_is_an_error(model: TrainableModel) -> None:
    client = model.openai_client()
    await client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "out"}], max_tokens=2
    )
    with pytest.raises(NothingCapturedError, match="outside the scope"):
        async with rollout(model):
            pass  # the call above was made before the scope
    other = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with pytest.raises(NothingCapturedError, match="not pointed at the trained model"):
        async with rollout(model) as scope:
            with pytest.raises(openai.APIConnectionError):
                await other.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(RuntimeError, match="after the `async with`"):
        _ = scope.trajectory


@ASYNC
async def test_records_are_freed_after_fetch_and_after_a_failure(
    model: TrainableModel, backend: LocalBackend
) -> None:
    client = model.openai_client()
    auth = {"Authorization": f"Bearer {model.inference_api_key}"}
    root = model.inference_base_url.removesuffix("/v1")
    async with rollout(model) as scope:
        await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "m"}], max_tokens=2
        )
        assert backend.recorder.stats() == {"rollouts": 1, "records": 1}
        async with httpx.AsyncClient() as http:
            peek = (await http.get(f"{root}/rollouts/{scope.id}/records", headers=auth)).json()
        assert len(peek["records"]) == 1 and peek["rollout_id"] == scope.id
    assert backend.recorder.stats() == {"rollouts": 0, "records": 0}
    assert len(scope.trajectory.turns) == 1
    with pytest.raises(ValueError, match="boom"):
        async with rollout(model):
            await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "m"}], max_tokens=2
            )
            raise ValueError("boom")
    assert backend.recorder.stats() == {"rollouts": 0, "records": 0}


@ASYNC
async def test_rollout_routes_check_ids_and_auth(model: TrainableModel) -> None:
    root = model.inference_base_url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {model.inference_api_key}"}
    body = {"model": model.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with httpx.AsyncClient() as http:
        bad_path = await http.post(f"{root}/rollouts/bad.id/v1/chat/completions", json=body, headers=auth)
        bad_header = await http.post(
            f"{root}/v1/chat/completions", json=body, headers={**auth, ROLLOUT_ID_HEADER: "x" * 65}
        )
        no_key = await http.get(f"{root}/rollouts/abc/records")
        unknown = await http.delete(f"{root}/rollouts/never-used", headers=auth)
    assert bad_path.status_code == 400 and bad_path.json()["error"]["code"] == "invalid_rollout_id"
    assert bad_header.status_code == 400 and bad_header.json()["error"]["param"] == ROLLOUT_ID_HEADER
    assert no_key.status_code == 401
    assert unknown.status_code == 200 and unknown.json() == {"rollout_id": "never-used", "records": []}
    with pytest.raises(ValueError, match="invalid rollout id"):
        validate_rollout_id("a/b")


@ASYNC
async def test_capture_works_the_same_through_remote_backend(tmp_path: Path) -> None:
    """The `art serve` app in a thread, reached only over HTTP through `RemoteBackend`."""
    from art_core.backends.remote import RemoteBackend
    from art_core.host import routes as training_api
    from art_core.host.service import ModelService
    from art_core.server.app import serve_in_thread

    key = "capture-remote-key-0123"
    service = ModelService(tmp_path)
    handle = serve_in_thread(training_api.create_server_app(service, api_key=key))
    backend = RemoteBackend(handle.url, api_key=key)
    try:
        model = TrainableModel(project="capture", name="remote", base_model="tiny-random")
        await model.register(backend)
        messages: list[Any] = [{"role": "user", "content": "remote"}]
        async with rollout(model) as scope:
            first = await model.openai_client().chat.completions.create(
                model=model.name, messages=messages, max_tokens=3
            )
            messages += [reply(first.choices[0]), {"role": "user", "content": "and"}]
            second = await litellm.acompletion(
                **model.litellm_completion_params(), messages=messages, max_tokens=3
            )
        assert [len(t.completion_ids) for t in scope.trajectory.turns] == [
            len(token_fields(c)["token_ids"]) for c in (first.choices[0], second.choices[0])
        ]
        assert_turn_matches(scope.trajectory.turns[0], first.choices[0])
        assert_turn_matches(scope.trajectory.turns[1], second.choices[0])
    finally:
        await backend.close()
        handle.stop()
        service.close()


# -- trajectory assembly --------------------------------------------------------------------------


@ASYNC
async def test_side_conversations_become_additional_histories_and_n_picks_the_continued_choice(
    model: TrainableModel,
) -> None:
    client = model.openai_client()
    main: list[Any] = [{"role": "user", "content": "main task"}]
    async with rollout(model) as scope:
        first = await client.chat.completions.create(model=model.name, messages=main, max_tokens=3, n=2)
        main += [reply(first.choices[1]), {"role": "user", "content": "go on"}]  # the caller picks choice 1
        side = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "summarise"}], max_tokens=3
        )
        last = await client.chat.completions.create(model=model.name, messages=main, max_tokens=3)
    trajectory = scope.trajectory
    assert [len(r.choices) for r in scope.records] == [2, 1, 1]
    assert_turn_matches(trajectory.turns[0], first.choices[1])
    assert_turn_matches(trajectory.turns[1], last.choices[0])
    assert trajectory.messages == [*main, reply(last.choices[0])]
    (history,) = trajectory.additional_histories
    assert_turn_matches(history.turns[0], side.choices[0])
    assert history.messages[0]["content"] == "summarise"


@ASYNC
async def test_decorator_returns_a_trajectory_with_the_reward(model: TrainableModel) -> None:
    client = model.openai_client()

    @rollout_scope(model)
    async def agent(task: str) -> float:
        scope = current_scope()
        assert scope is not None
        scope.metrics["calls"] = 1
        await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": task}], max_tokens=2
        )
        return 1.0

    answered: list[float] = []

    @rollout_scope(model)
    async def builds_its_own(task: str) -> Trajectory:
        messages: list[Any] = [{"role": "user", "content": task}]
        response = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=2)
        answered.append(time.time())
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        tool_result = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        return Trajectory(messages=[*messages, reply(response.choices[0]), *tool_result], reward=0.25)

    @rollout_scope(model)
    async def wrong() -> str:
        await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "w"}], max_tokens=1
        )
        return "oops"

    trajectory = await agent("decorated")
    assert trajectory.reward == 1.0 and trajectory.metrics["calls"] == 1 and len(trajectory.turns) == 1
    assert trajectory.messages[0]["content"] == "decorated"
    before_own = time.time()
    own = await builds_its_own("own")
    assert own.reward == 0.25 and len(own.turns) == 1
    # built after its call, it takes the scope's start (before the call) as its own
    assert before_own <= own.start_time < answered[0]
    assert own.messages[-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "ok",
    }  # its fuller messages kept
    with pytest.raises(TypeError, match="returned str"):
        await wrong()


def record(seq: int, messages: list[Any], *replies: str, prompt: int = 0) -> CallRecord:
    """A synthetic record whose prompt ids encode the message count (for assembly unit tests)."""
    choices = [
        RecordedChoice(
            message={"role": "assistant", "content": text},
            turn=Turn(prompt_ids=[prompt or len(messages)], completion_ids=[seq, k], logprobs=[-1.0, -1.0]),
        )
        for k, text in enumerate(replies)
    ]
    return CallRecord(seq=seq, model="m", messages=messages, choices=choices)


def test_assembly_orders_by_arrival_and_groups_histories() -> None:
    user = {"role": "user", "content": "u"}
    a = {"role": "assistant", "content": "a"}
    call = {"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    with_tool = {"role": "assistant", "tool_calls": [call]}  # content omitted: echoed without None fields
    tool = {"role": "tool", "tool_call_id": "t", "content": "r"}
    records = [
        record(3, [user, a, user, {**with_tool, "content": None, "refusal": None}, tool], "end"),
        record(1, [user], "a"),
        record(0, [user], "retried"),  # a retry the caller threw away
        record(2, [user, a, user], "x", "y"),
        record(4, [{"role": "user", "content": "judge"}], "j"),
    ]
    records[3].choices[1].message["tool_calls"] = [
        {**call, "function": {"name": "f", "arguments": '{ "x":1 }'}}
    ]
    records[3].choices[1].message["content"] = None
    trajectory = trajectory_from_records(records, reward=1.0)
    assert [t.completion_ids[0] for t in trajectory.turns] == [1, 2, 3]
    assert trajectory.turns[1].completion_ids == [2, 1]  # choice 1 was continued
    assert trajectory.messages[-1]["content"] == "end" and trajectory.reward == 1.0
    assert [[t.completion_ids[0] for t in h.turns] for h in trajectory.additional_histories] == [[0], [4]]
    with pytest.raises(ValueError, match="no records"):
        trajectory_from_records([])


def test_recorder_bounds_memory(caplog: pytest.LogCaptureFixture) -> None:
    recorder = RolloutRecorder(RecorderConfig(max_rollouts=2, max_records_per_rollout=2, ttl_s=60))
    one = record(0, [{"role": "user", "content": "u"}], "a")
    with caplog.at_level(logging.WARNING, logger="art_core.capture"):
        for _ in range(3):
            recorder.record("r1", one)
        recorder.record("r2", one)
        recorder.record("r3", one)  # evicts r1, the least recently used
    assert recorder.stats() == {"rollouts": 2, "records": 2}
    assert recorder.peek("r1") == [] and recorder.pop("r2") == [one] and recorder.pop("r2") == []
    assert "dropping later ones" in caplog.text and "max_rollouts=2" in caplog.text
    expiring = RolloutRecorder(RecorderConfig(ttl_s=1e-9))
    expiring.record("old", one)
    with caplog.at_level(logging.WARNING, logger="art_core.capture"):
        expiring.record("new", one)
    assert expiring.stats() == {"rollouts": 1, "records": 1} and "abandoned" in caplog.text
    with pytest.raises(ValueError):
        RecorderConfig(ttl_s=0)


# -- a real tool-calling model ----------------------------------------------------------------------

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.slow
@ASYNC
async def test_smollm2_tool_calling_conversation_is_one_sequence(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    model = TrainableModel(project="capture", name="smol", base_model="smollm2-135m")
    await model.register(backend)
    client = model.openai_client()
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."},
    ]
    try:
        async with rollout(model) as scope:
            for _ in range(2):
                response = await client.chat.completions.create(
                    model=model.name, messages=messages, tools=[WEATHER_TOOL], max_tokens=48, temperature=0
                )
                message = reply(response.choices[0])
                messages.append(message)
                for call in message.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"})
                if not message.get("tool_calls"):
                    messages.append({"role": "user", "content": "Thanks. And in Rome?"})
    finally:
        await backend.close()
    trajectory = scope.trajectory
    assert trajectory.tools == [WEATHER_TOOL] and len(trajectory.turns) == 2
    assert trajectory.messages == messages[: len(trajectory.messages)]
    roles = [m["role"] for m in trajectory.messages]
    if any(m.get("tool_calls") for m in trajectory.messages):  # the model chose to call the tool
        assert "tool" in roles
    complete = all(t.finish_reason != "length" for t in trajectory.turns[:-1])
    if complete:  # real text re-renders to the same tokens, so the turns merge into one sequence
        assert len(trajectory_sequences(trajectory)) == 1
