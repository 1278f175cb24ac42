"""Overload behaviour of the real server on 127.0.0.1: bounded queues, 429/503 with Retry-After, no crash.

The engine admits at most `EngineConfig.max_queued_rows` rows (16 here); past it a request gets 429
at once. The app admits at most `max_concurrent_requests` HTTP requests in flight; past it, 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from art_core.engine.config import EngineConfig
from art_core.engine.torch.engine import TorchEngine
from art_core.models.loading import LoadedModel
from art_core.server.app import ServerHandle, create_app, serve_in_thread
from art_core.server.router import ServedModel, StaticRouter

CAPACITY = 16
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[tuple[ServerHandle, TorchEngine]]:
    config = EngineConfig(max_context=128, max_queued_rows=CAPACITY)
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, config)
    router = StaticRouter({"tiny": ServedModel(engine, tiny_model.tokenizer, None, 128)})
    handle = serve_in_thread(create_app(router))
    yield handle, engine
    handle.stop()
    engine.close()


def body(**kwargs: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kwargs}


def assert_overload_error(response: httpx.Response) -> None:
    """A 429/503 in OpenAI's error shape, with an integer Retry-After a client can honour."""
    assert response.status_code in (429, 503), response.text
    assert 1 <= int(response.headers["retry-after"]) <= 60
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if response.status_code == 429:
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded"
        assert "max_queued_rows" in error["message"]


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.01)


async def test_256_concurrent_requests_get_200_or_429_and_the_server_recovers(
    server: tuple[ServerHandle, TorchEngine],
) -> None:
    handle, engine = server
    started = time.monotonic()
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(base_url=handle.url, limits=limits, timeout=60) as client:
        requests = [body(n=1 + i % 4, seed=i) for i in range(256)]
        responses = await asyncio.gather(*[client.post("/v1/chat/completions", json=b) for b in requests])
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        for request, response in zip(requests, responses, strict=True):
            if response.status_code == 200:
                assert len(response.json()["choices"]) == request["n"]
            else:
                assert_overload_error(response)
        await wait_for(lambda: engine.pending_rows() == 0)
        after = await client.post("/v1/chat/completions", json=body(n=2))
        assert after.status_code == 200 and len(after.json()["choices"]) == 2
    assert engine.pending_rows() == 0
    assert time.monotonic() - started < 60


async def test_requests_queued_during_a_pause_count_against_capacity(
    server: tuple[ServerHandle, TorchEngine],
) -> None:
    handle, engine = server
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as client:
        engine.pause()  # as during a train step: admitted requests wait, nothing is dropped
        try:
            waiting = [
                asyncio.create_task(client.post("/v1/chat/completions", json=body(n=4))) for _ in range(4)
            ]
            await wait_for(lambda: engine.pending_rows() == CAPACITY)
            refused = await client.post("/v1/chat/completions", json=body(n=1))
            assert refused.status_code == 429
            assert_overload_error(refused)
            assert not any(task.done() for task in waiting)
        finally:
            engine.resume()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 4
        await wait_for(lambda: engine.pending_rows() == 0)
        assert (await client.post("/v1/chat/completions", json=body())).status_code == 200


async def test_the_openai_client_retries_a_429_after_retry_after(
    server: tuple[ServerHandle, TorchEngine],
) -> None:
    handle, engine = server
    client = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=2)
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as http:
        engine.pause()
        try:
            full = [asyncio.create_task(http.post("/v1/chat/completions", json=body(n=4))) for _ in range(4)]
            await wait_for(lambda: engine.pending_rows() == CAPACITY)
            started = time.monotonic()
            retried = asyncio.create_task(client.chat.completions.create(**body()))
            await asyncio.sleep(0.3)  # the first try has been refused with Retry-After: 1
        finally:
            engine.resume()
        assert (await retried).choices[0].message.content is not None
        assert time.monotonic() - started >= 0.9  # it waited out Retry-After
        assert [r.status_code for r in await asyncio.gather(*full)] == [200] * 4
    await client.close()


def test_n_above_capacity_is_a_400_not_a_429(server: tuple[ServerHandle, TorchEngine]) -> None:
    response = httpx.post(server[0].url + "/v1/chat/completions", json=body(n=CAPACITY + 1))
    assert response.status_code == 400 and "max_queued_rows" in response.json()["error"]["message"]
    assert "retry-after" not in response.headers


async def test_requests_in_flight_past_the_limit_get_503(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(max_context=128))
    router = StaticRouter({"tiny": ServedModel(engine, tiny_model.tokenizer, None, 128)})
    handle = serve_in_thread(create_app(router, max_concurrent_requests=2))
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as client:
            engine.pause()
            try:
                held = [
                    asyncio.create_task(client.post("/v1/chat/completions", json=body())) for _ in range(2)
                ]
                await wait_for(lambda: engine.pending_rows() == 2)
                busy = await client.get("/v1/models")
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_overloaded"
                assert_overload_error(busy)
                assert (await client.get("/health")).status_code == 200  # exempt: alive while busy
            finally:
                engine.resume()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            assert (await client.get("/v1/models")).status_code == 200
    finally:
        handle.stop()
        engine.close()


def test_a_closed_engine_is_a_503_with_retry_after(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(max_context=128))
    router = StaticRouter({"tiny": ServedModel(engine, tiny_model.tokenizer, None, 128)})
    handle = serve_in_thread(create_app(router))
    try:
        engine.close()  # what a shutting-down server's requests meet
        response = httpx.post(handle.url + "/v1/chat/completions", json=body())
        assert response.status_code == 503
        assert_overload_error(response)
    finally:
        handle.stop()


def test_capacity_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_queued_rows"):
        EngineConfig(max_queued_rows=0)
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        create_app(StaticRouter({}), max_concurrent_requests=0)
