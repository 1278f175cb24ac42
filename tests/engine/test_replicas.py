"""Several inference replicas (issue 21 item 4): `ReplicatedEngine` over two real TorchEngines on the
tiny model, and `TorchServing(replicas=2, replica_processes=False)` behind the real HTTP server.

Stickiness by rollout and by prompt prefix, new rollouts spread by load, an adapter published to
every replica before a request can name it, a train step's LoRA reaching both replicas before
either serves again, and a replica that dies: its queued request retried on the other one, a
stream that had sent tokens failing with ReplicaDownError (an SSE error event over HTTP), the
server answering on, and the replica rebuilt: it serves the current step, a step or an adapter
published while it was being rebuilt included, and it is left down, logged, when it cannot be.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from art_core.backends import LocalBackend
from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.deltas import token_stream
from art_core.engine.errors import EngineClosedError, EngineOverloadedError
from art_core.engine.protocol import Engine
from art_core.engine.replicas import (
    NoLiveReplicaError,
    ReplicaDownError,
    ReplicatedEngine,
    RoutingConfig,
    block_hashes,
    least_loaded,
)
from art_core.engine.revival import ReplicaFactory, ReviveConfig, backoff_delays
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.engine import TorchEngine
from art_core.host.service import LIVE_ADAPTER, HostedModel, ModelService
from art_core.host.serving import TorchServing
from art_core.model import TrainableModel
from art_core.models.loading import load_model
from art_core.server.app import create_app, serve_in_thread
from art_core.server.router import ServedModel, StaticRouter
from tests.host.test_exact_resume import CONFIG, SPEC, groups

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
FAST = ReviveConfig(backoff_s=0.05, max_backoff_s=0.05)
"""Rebuild a dead replica at once (the default waits a second first)."""


@pytest.fixture
def pair() -> Iterator[ReplicatedEngine]:
    """Two TorchEngines, each on its own copy of the tiny model, behind one router."""
    loaded = [load_model("tiny-random") for _ in range(2)]
    engines = [TorchEngine(m.model, m.tokenizer) for m in loaded]
    replicated = ReplicatedEngine(engines, RoutingConfig(prefix_block_tokens=4))
    yield replicated
    replicated.close()


def request(prompt: list[int], affinity: str | None = None, n: int = 1) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=4, n=n)
    return GenerationRequest(prompt, params, affinity=affinity)


def served_by(engine: ReplicatedEngine) -> list[int]:
    return [s.requests for s in engine.status()]


async def until(condition: object, timeout: float = 30.0) -> None:
    """Wait until `condition()` holds (requests are dispatched as soon as their task runs)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_routing_math() -> None:
    assert least_loaded([3, 1, None, 1], start=0) == 1
    assert least_loaded([3, 1, None, 1], start=2) == 3  # ties rotate
    assert least_loaded([None, None], start=0) is None
    ids = list(range(10))
    assert len(block_hashes(ids, 4)) == 2  # whole blocks only
    assert block_hashes(ids, 4) == block_hashes([*ids, 99], 4)[:2]  # a longer prompt extends the chain
    assert block_hashes([1, 2, 3, 4], 4) != block_hashes([1, 2, 3, 5], 4)
    with pytest.raises(ValueError, match="prefix_match"):
        RoutingConfig(prefix_match=0)
    with pytest.raises(ValueError, match="replicas"):
        TorchServing(replicas=0)
    assert backoff_delays(ReviveConfig(max_attempts=4, backoff_s=1, max_backoff_s=3)) == [1, 2, 3, 3]
    assert backoff_delays(ReviveConfig(max_attempts=0)) == []
    with pytest.raises(ValueError, match="max_backoff_s"):
        ReviveConfig(backoff_s=2, max_backoff_s=1)


async def test_a_rollout_stays_on_one_replica_and_new_ones_spread_by_load(pair: ReplicatedEngine) -> None:
    pair.pause()  # requests queue: what is in flight is what the router sees
    tasks = [asyncio.ensure_future(pair.generate(request([5, 6, 7 + i], f"r{i}"))) for i in range(4)]
    await until(lambda: sum(served_by(pair)) == 4)
    assert [s.in_flight_rows for s in pair.status()] == [2, 2]  # four new rollouts, two each
    pair.resume()
    await asyncio.gather(*tasks)
    homes = {}
    for i in range(4):
        before = served_by(pair)
        await asyncio.gather(*[pair.generate(request([5, 6, 7 + i, 8, 9], f"r{i}")) for _ in range(3)])
        after = served_by(pair)
        moved = [b - a for a, b in zip(before, after, strict=True)]
        assert sorted(moved) == [0, 3], moved  # every later call of the rollout went to one replica
        homes[i] = moved.index(3)
    assert sorted(homes.values()) == [0, 0, 1, 1]
    assert [s.in_flight_rows for s in pair.status()] == [0, 0]


async def test_without_a_key_the_prompt_prefix_keeps_a_conversation_together(pair: ReplicatedEngine) -> None:
    turn1 = list(range(10, 22))
    (first,) = await pair.generate(request(turn1))
    home = served_by(pair).index(1)
    # The next turn extends the previous prompt and its completion: same replica, three times over.
    turn2 = turn1 + first.token_ids + [30, 31, 32]
    for _ in range(3):
        await pair.generate(request(turn2))
    assert served_by(pair)[home] == 4
    # An unrelated prompt goes to the less loaded replica while the other is busy.
    pair.pause()
    busy = asyncio.ensure_future(pair.generate(request(turn2, n=2)))
    other = asyncio.ensure_future(pair.generate(request(list(range(50, 62)))))
    await until(lambda: sum(served_by(pair)) == 6)
    assert [s.in_flight_rows for s in pair.status()][1 - home] == 1
    pair.resume()
    await asyncio.gather(busy, other)


async def test_an_adapter_is_on_every_replica_before_it_can_be_named(
    pair: ReplicatedEngine, tmp_path: Path
) -> None:
    from art_core.training.lora import LoRAConfig, attach_lora

    saved = attach_lora(load_model("tiny-random").model, LoRAConfig(r=4, alpha=8), adapter_name="ad")
    with torch.no_grad():
        for name, param in saved.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    saved.save_pretrained(tmp_path / "ad", selected_adapters=["ad"])
    folder = tmp_path / "ad" / "ad" if (tmp_path / "ad" / "ad").exists() else tmp_path / "ad"
    pair.add_adapter("step1", folder)
    assert all("step1" in e.adapters() for e in pair.replicas) and pair.adapters() == ["step1"]
    outs = [await e.generate(GenerationRequest([5, 6, 7], GREEDY, "step1")) for e in pair.replicas]
    assert outs[0][0].token_ids == outs[1][0].token_ids
    pair.add_adapter("step2", folder)
    pair.remove_adapter("step1")
    assert all(e.adapters() == ["step2"] for e in pair.replicas)


async def test_a_full_replica_passes_the_request_on_until_all_are_full() -> None:
    loaded = [load_model("tiny-random") for _ in range(2)]
    engines = [TorchEngine(m.model, m.tokenizer, EngineConfig(max_queued_rows=1)) for m in loaded]
    pair = ReplicatedEngine(engines)
    try:
        pair.pause()
        first = asyncio.ensure_future(pair.generate(request([5, 6, 7], "a")))
        await until(lambda: sum(s.in_flight_rows for s in pair.status()) == 1)
        home = [s.in_flight_rows for s in pair.status()].index(1)
        second = asyncio.ensure_future(pair.generate(request([5, 6, 7, 8], "a")))  # its home is full
        await until(lambda: [s.in_flight_rows for s in pair.status()] == [1, 1])
        with pytest.raises(EngineOverloadedError):  # both full: the caller hears it (HTTP 429)
            await pair.generate(request([9, 9], "b"))
        assert [s.in_flight_rows for s in pair.status()] == [1, 1] and pair.live() == [0, 1]
        pair.resume()
        await asyncio.gather(first, second)
        # Sends: the first; the second at its full home, then the other; the third at both.
        assert sum(s.requests for s in pair.status()) == 5 and pair.status()[home].requests >= 2
    finally:
        pair.close()


def test_the_affinity_key_is_the_rollout_id_else_the_user_field() -> None:
    from art_core.server.chat_completion import affinity_key
    from art_core.server.openai_format import ChatCompletionRequest

    messages = [{"role": "user", "content": "x"}]
    plain = ChatCompletionRequest(model="m", messages=messages)
    with_user = ChatCompletionRequest(model="m", messages=messages, user="u1")
    assert affinity_key(plain, None) is None
    assert affinity_key(with_user, None) == "user:u1"
    assert affinity_key(with_user, "r1") == affinity_key(plain, "r1") == "rollout:r1"


async def test_a_dead_replicas_queued_request_is_retried_on_the_other(pair: ReplicatedEngine) -> None:
    pair.pause()
    task = asyncio.ensure_future(pair.generate(request([5, 6, 7], "doomed")))
    await until(lambda: sum(served_by(pair)) == 1)
    dead = served_by(pair).index(1)
    pair.replicas[dead].close()  # its queued rows fail with EngineClosedError
    pair.resume()  # resumes the live one only
    (completion,) = await asyncio.wait_for(task, 60)
    assert completion.token_ids
    status = pair.status()
    assert not status[dead].alive and "closed" in (status[dead].down_reason or "")
    assert status[1 - dead].requests == 1
    # The rollout's later calls, and streams, go to the live replica; closing it too leaves none.
    await pair.generate(request([5, 6, 7, 8], "doomed"))
    stream = token_stream(pair, request([5, 6], "new"))
    assert [d async for d in stream]
    assert pair.status()[dead].requests == 1
    pair.replicas[1 - dead].close()
    with pytest.raises(NoLiveReplicaError) as refused:
        await pair.generate(request([5, 6, 7]))
    assert isinstance(refused.value, EngineClosedError)  # the server answers 503


async def test_a_train_step_reaches_every_replica_before_either_serves(tmp_path: Path) -> None:
    service = ModelService(tmp_path, TorchServing(replicas=2, replica_processes=False))
    try:
        hosted = service.register(SPEC)
        replicated = hosted.engine
        assert isinstance(replicated, ReplicatedEngine) and hosted.copies is not None
        first, second = replicated.replicas
        prompt = GenerationRequest([5, 6, 7, 8], GREEDY, LIVE_ADAPTER)
        before = [(await e.generate(prompt))[0].token_ids for e in (first, second)]
        assert before[0] == before[1]
        copy = hosted.copies.copies[0]
        old = {n: p.clone() for n, p in copy.named_parameters() if f".{LIVE_ADAPTER}." in n}
        # Requests that arrive while the step trains wait in both replicas and run on the new weights
        # (paused here already; the step's own pause is the same pause, its resume lets them run).
        replicated.pause()
        waiting = [asyncio.ensure_future(e.generate(prompt)) for e in (first, second)]
        result = await service.train(SPEC.name, groups(1), CONFIG)
        assert result.trained, result.warnings
        after_waiting = [(await t)[0].token_ids for t in waiting]
        after = [(await e.generate(prompt))[0].token_ids for e in (first, second)]
        assert after[0] == after[1] and after_waiting == after
        trained = dict(hosted.trainer.model.named_parameters())
        for name, param in copy.named_parameters():
            if name in old:
                assert torch.equal(param, trained[name]), name
        assert any(not torch.equal(old[n], p) for n, p in copy.named_parameters() if n in old)
    finally:
        service.close()


async def test_the_server_keeps_serving_when_a_replica_dies(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, serving=TorchServing(replicas=2, replica_processes=False, revive=FAST))
    model = TrainableModel(project="replicas", name="agent", base_model="tiny-random")
    await model.register(backend)
    try:
        replicated = backend.service.get("agent").engine
        assert isinstance(replicated, ReplicatedEngine)
        url = f"{model.inference_base_url}/chat/completions"
        auth = {"Authorization": f"Bearer {model.inference_api_key}"}
        body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(timeout=120) as http:

            async def chat(rollout: str) -> httpx.Response:
                return await http.post(url, json=body, headers={**auth, "X-Rollout-Id": rollout})

            for rollout in ("a", "a", "b", "b", "a"):
                assert (await chat(rollout)).status_code == 200
            assert sorted(s.requests for s in replicated.status()) == [2, 3]  # one replica per rollout
            replicated.replicas[0].close()  # replica 0 dies
            responses = await asyncio.gather(*[chat(r) for r in ("a", "b", "c", "d")])
            assert [r.status_code for r in responses] == [200] * 4
            status = replicated.status()
            assert status[1].alive and (not status[0].alive or status[0].restarts == 1)  # or back already
            # It is rebuilt (on the trainer's model: replica 0) and takes new rollouts again.
            await until(lambda: replicated.status()[0].alive)
            responses = await asyncio.gather(*[chat(r) for r in ("e", "f", "g", "h")])
            assert [r.status_code for r in responses] == [200] * 4
            assert replicated.status()[0].restarts == 1 and replicated.status()[0].requests > 0
    finally:
        await backend.close()


def die_at_forward(engine: TorchEngine, forward: int) -> Any:
    """Make `engine` die in the middle of decoding: at its model's `forward`-th pass the output head
    closes the engine and raises, as a worker lost mid-batch. Returns the hook's handle."""
    calls = 0

    def hook(*_: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == forward:
            engine.close()  # from the worker itself: it stops after this batch, which fails
            raise RuntimeError("replica lost mid-batch")

    return engine.model.lm_head.register_forward_pre_hook(hook)


async def test_a_stream_that_sent_tokens_fails_when_its_replica_dies(pair: ReplicatedEngine) -> None:
    handles = [die_at_forward(e, 5) for e in pair.replicas]  # type: ignore[arg-type]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seen = []
    try:
        with pytest.raises(ReplicaDownError, match="died while streaming") as down:
            async for deltas in token_stream(pair, GenerationRequest([5, 6, 7], long, affinity="s")):
                seen.append(deltas)
    finally:
        for handle in handles:
            handle.remove()
    assert seen and isinstance(down.value, EngineClosedError)  # sent tokens are not resent elsewhere
    status = pair.status()
    assert [s.alive for s in status].count(False) == 1 and pair.stats().replicas_down == 1
    (completion,) = await pair.generate(request([5, 6, 7], "s"))  # the rollout goes on elsewhere
    assert completion.token_ids


def test_over_http_a_replicas_death_mid_stream_is_an_sse_error_event(pair: ReplicatedEngine) -> None:
    tokenizer = load_model("tiny-random").tokenizer
    handle = serve_in_thread(create_app(StaticRouter({"tiny": ServedModel(pair, tokenizer, None, 512)})))
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
    body: Any = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
    hooks = [die_at_forward(e, 5) for e in pair.replicas]  # type: ignore[arg-type]
    try:
        stream = client.chat.completions.create(
            **body, max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = []
        with pytest.raises(openai.APIError, match="died while streaming") as raised:
            for chunk in stream:
                chunks.append(chunk)
        assert raised.value.code == "replica_down"  # the server is up: send the request again
        assert chunks and all(c.choices[0].finish_reason is None for c in chunks)  # no clean end
        for hook in hooks:
            hook.remove()
        assert client.chat.completions.create(**body, max_tokens=3).choices[0].message is not None
    finally:
        for hook in hooks:
            hook.remove()
        handle.stop()


def live_lora(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{LIVE_ADAPTER}." in n}


def assert_replicas_agree(hosted: HostedModel, outputs: list[Any]) -> None:
    """The copy's LoRA is the trainer's, and both replicas sample the same tokens with the same logprobs."""
    assert hosted.copies is not None
    trained = live_lora(hosted.trainer.model)
    for name, param in live_lora(hosted.copies.copies[0]).items():
        assert torch.equal(param, trained[name]), name
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[0].logprobs == pytest.approx(outputs[1].logprobs, abs=1e-6)


async def greedy_on_each(replicated: ReplicatedEngine, adapter: str = LIVE_ADAPTER) -> list[Any]:
    prompt = GenerationRequest([5, 6, 7, 8], GREEDY, adapter)
    return [(await e.generate(prompt))[0] for e in replicated.replicas]


async def test_a_killed_replica_comes_back_serving_the_current_step(tmp_path: Path) -> None:
    service = ModelService(tmp_path, TorchServing(replicas=2, replica_processes=False, revive=FAST))
    try:
        hosted = service.register(SPEC)
        replicated = hosted.engine
        assert isinstance(replicated, ReplicatedEngine)
        dead = replicated.replicas[1]
        step0 = live_lora(hosted.trainer.model)
        dead.close()  # replica 1 dies idle; the train step's pause notices, its rebuild waits for resume
        assert (await service.train(SPEC.name, groups(1), CONFIG)).trained
        await until(lambda: replicated.status()[1].alive)
        assert replicated.replicas[1] is not dead and replicated.status()[1].restarts == 1
        assert_replicas_agree(hosted, await greedy_on_each(replicated))
        assert any(not torch.equal(step0[n], p) for n, p in live_lora(hosted.copies.copies[0]).items())  # type: ignore[union-attr]
        # The next step is published to it as to any replica.
        assert (await service.train(SPEC.name, groups(1), CONFIG)).trained
        assert_replicas_agree(hosted, await greedy_on_each(replicated))
        stats = replicated.stats()
        assert (stats.replicas_down, stats.replica_restarts, stats.replicas_lost) == (0, 1, 0)
    finally:
        service.close()


class GatedBuilds:
    """A real factory whose builds wait for `gate`, so that a test can publish while one is under way."""

    def __init__(self, inner: ReplicaFactory) -> None:
        self.inner = inner
        self.gate, self.building, self.built = threading.Event(), threading.Event(), threading.Event()

    def build(self, index: int) -> Engine:
        self.building.set()
        assert self.gate.wait(120), "the test never opened the gate"
        engine = self.inner.build(index)
        self.built.set()
        return engine

    def catch_up(self, index: int, engine: Engine) -> None:
        self.inner.catch_up(index, engine)


async def test_a_publish_during_a_rebuild_reaches_the_rebuilt_replica(tmp_path: Path) -> None:
    service = ModelService(tmp_path, TorchServing(replicas=2, replica_processes=False, revive=FAST))
    try:
        hosted = service.register(SPEC)
        replicated = hosted.engine
        assert isinstance(replicated, ReplicatedEngine) and replicated.factory is not None
        gated = GatedBuilds(replicated.factory)
        replicated.factory = gated
        replicated.replicas[1].close()
        replicated.adapters()  # notices the dead replica: its rebuild starts and waits at the gate
        await until(gated.building.is_set)
        # While it is rebuilt: a train step publishes step 1, and an adapter is published by name.
        assert (await service.train(SPEC.name, groups(1), CONFIG)).trained
        replicated.add_adapter("step0", hosted.storage.checkpoint_dir(0))
        # A rebuilt engine never joins while the replicas are paused (a step may be training).
        replicated.pause()
        gated.gate.set()
        await until(gated.built.is_set)
        await asyncio.sleep(0.3)
        assert not replicated.status()[1].alive
        replicated.resume()
        await until(lambda: replicated.status()[1].alive)
        assert "step0" in replicated.replicas[1].adapters()
        assert_replicas_agree(hosted, await greedy_on_each(replicated))
        assert_replicas_agree(hosted, await greedy_on_each(replicated, "step0"))
        replicated.remove_adapter("step0")  # it is the rebuilt engine's to remove, as any replica's
        assert "step0" not in replicated.replicas[1].adapters()
    finally:
        service.close()


class NoRoom:
    """A factory that can never build (no memory for another replica, say)."""

    def build(self, index: int) -> Engine:
        raise RuntimeError("no memory for another replica")

    def catch_up(self, index: int, engine: Engine) -> None:
        raise AssertionError("nothing was built")


async def test_a_replica_that_cannot_be_rebuilt_stays_down_loudly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="art_core.engine")
    engines = [TorchEngine(m.model, m.tokenizer) for m in (load_model("tiny-random") for _ in range(2))]
    revive = ReviveConfig(max_attempts=2, backoff_s=0.01, max_backoff_s=0.01)
    pair = ReplicatedEngine(engines, factory=NoRoom(), revive=revive)
    try:
        engines[0].close()
        (completion,) = await pair.generate(request([5, 6, 7]))  # sent to replica 0, retried on 1
        assert completion.token_ids
        await until(lambda: not pair.status()[0].reviving)
        stats = pair.stats()
        assert (stats.replicas_down, stats.replicas_lost, stats.replica_restarts) == (1, 1, 0)
        assert caplog.text.count("rebuilding inference replica 0 failed") == 2
        assert any(r.levelno == logging.ERROR and "stays down" in r.getMessage() for r in caplog.records)
        assert (await pair.generate(request([5, 6, 7])))[0].token_ids  # replica 1 serves on
    finally:
        pair.close()
