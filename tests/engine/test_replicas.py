"""Several inference replicas (issue 21 item 4): `ReplicatedEngine` over two real TorchEngines on the
tiny model, and `TorchServing(replicas=2)` behind the real HTTP server.

Stickiness by rollout and by prompt prefix, new rollouts spread by load, an adapter published to
every replica before a request can name it, a train step's LoRA reaching both replicas before
either serves again, and a replica that dies: its queued request retried on the other one, the
server answering on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from art_core.backends import LocalBackend
from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.deltas import token_stream
from art_core.engine.errors import EngineClosedError, EngineOverloadedError
from art_core.engine.replicas import (
    NoLiveReplicaError,
    ReplicatedEngine,
    RoutingConfig,
    block_hashes,
    least_loaded,
)
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.engine import TorchEngine
from art_core.host.service import LIVE_ADAPTER, ModelService
from art_core.host.serving import TorchServing
from art_core.model import TrainableModel
from art_core.models.loading import load_model
from tests.host.test_exact_resume import CONFIG, SPEC, groups

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


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
    service = ModelService(tmp_path, TorchServing(replicas=2))
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
    backend = LocalBackend(tmp_path, serving=TorchServing(replicas=2))
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
            assert not status[0].alive and status[1].alive
    finally:
        await backend.close()
