"""Replicas in child processes (issue 21 item 4): `TorchServing(replicas=2)` runs each TorchEngine in a
`ProcessEngine` child, on the tiny model, behind the real HTTP server.

Both replicas answer over HTTP (whole and streamed) and sample what one in-process TorchEngine on
the trainer's model samples, before and after a train step (the step's LoRA reaches both through
shared memory before either serves again); a child killed with SIGKILL while idle is marked down
at once, the server answers on, and the replica comes back serving the current step; a child that
cannot start raises with its error. The replica mode is a checked option of `TorchServing` and
`art serve`.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from art_core.app.cli import serving_config
from art_core.backends import LocalBackend
from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.errors import EngineOverloadedError
from art_core.engine.grammar import Grammar
from art_core.engine.replicas import ReplicatedEngine
from art_core.engine.revival import ReviveConfig
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.engine import TorchEngine
from art_core.engine.torch.process_engine import ProcessEngine, ReplicaStartError
from art_core.host.service import LIVE_ADAPTER, HostedModel
from art_core.host.serving import TorchServing
from art_core.host.torch_replicas import ProcessLora, ReplicaModel
from art_core.model import TrainableModel
from art_core.training.config import LoRAConfig
from tests.host.test_exact_resume import CONFIG, groups

FAST = ReviveConfig(backoff_s=0.05, max_backoff_s=0.05)
PROMPT = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6), LIVE_ADAPTER)


async def until(condition: Any, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def assert_replicas_serve_the_trainers_lora(hosted: HostedModel) -> list[int]:
    """Each replica process samples what a TorchEngine on the trainer's own model samples; returns the ids."""
    replicated = hosted.engine
    assert isinstance(replicated, ReplicatedEngine)
    reference = TorchEngine(hosted.trainer.model, hosted.loaded.tokenizer)
    try:
        (expected,) = await reference.generate(PROMPT)
    finally:
        reference.close()
    for engine in replicated.replicas:
        assert isinstance(engine, ProcessEngine)
        (got,) = await engine.generate(PROMPT)
        assert got.token_ids == expected.token_ids
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    return expected.token_ids


async def register(tmp_path: Path) -> tuple[LocalBackend, TrainableModel, HostedModel]:
    backend = LocalBackend(tmp_path, serving=TorchServing(replicas=2, revive=FAST))
    model = TrainableModel(project="procs", name="agent", base_model="tiny-random")
    await model.register(backend)
    hosted = backend.service.get("agent")
    assert isinstance(hosted.copies, ProcessLora)
    return backend, model, hosted


async def test_two_replica_processes_serve_over_http_and_follow_each_step(tmp_path: Path) -> None:
    backend, model, hosted = await register(tmp_path)
    try:
        replicated = hosted.engine
        assert isinstance(replicated, ReplicatedEngine)
        client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
        body: Any = {
            "model": "agent",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0.0,
        }
        answers = await asyncio.gather(
            *[client.chat.completions.create(**body, user=rollout) for rollout in ("a", "b", "c", "d")]
        )
        assert all(s.requests > 0 for s in replicated.status())  # both replicas answered
        texts = {a.choices[0].message.content for a in answers}
        assert len(texts) == 1  # greedy: the same answer from either process
        stream = await client.chat.completions.create(**body, user="e", stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert {streamed} == texts
        await client.close()
        before = await assert_replicas_serve_the_trainers_lora(hosted)
        result = await backend.service.train("agent", groups(1), CONFIG)
        assert result.trained, result.warnings
        after = await assert_replicas_serve_the_trainers_lora(hosted)
        assert after != before  # the step changed what is served, on both
        assert replicated.stats().batches > 0
    finally:
        await backend.close()


async def test_a_killed_replica_process_is_noticed_revived_and_serves_the_current_step(
    tmp_path: Path,
) -> None:
    backend, model, hosted = await register(tmp_path)
    try:
        replicated = hosted.engine
        assert isinstance(replicated, ReplicatedEngine)
        victim = replicated.replicas[1]
        assert isinstance(victim, ProcessEngine) and victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)  # idle: no request is running on it
        await until(lambda: not replicated.status()[1].alive or replicated.status()[1].restarts == 1)
        client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
        body: Any = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answers = await asyncio.gather(*[client.chat.completions.create(**body, user=r) for r in "abcd"])
        assert all(a.choices[0].message.content is not None for a in answers)  # served by replica 0
        # A step trains while replica 1 may still be rebuilding: it rejoins serving that step.
        assert (await backend.service.train("agent", groups(1), CONFIG)).trained
        await until(lambda: replicated.status()[1].alive)
        assert replicated.replicas[1] is not victim and replicated.status()[1].restarts == 1
        await assert_replicas_serve_the_trainers_lora(hosted)
        answers = await asyncio.gather(*[client.chat.completions.create(**body, user=r) for r in "efgh"])
        assert replicated.status()[1].requests > 0
        await client.close()
        stats = replicated.stats()
        assert (stats.replicas_down, stats.replica_restarts, stats.replicas_lost) == (0, 1, 0)
    finally:
        await backend.close()


def test_a_replica_process_that_cannot_start_raises_its_error() -> None:
    from art_core.engine.torch.process_engine import SharedLora
    from art_core.models.loading import load_model
    from art_core.training.lora import attach_lora

    model = attach_lora(load_model("tiny-random").model, LoRAConfig(), adapter_name=LIVE_ADAPTER)
    build = ReplicaModel("no-such-model-anywhere", False, LoRAConfig(), LIVE_ADAPTER)
    with pytest.raises(ReplicaStartError, match="failed to start") as failed:
        ProcessEngine(build, SharedLora.of(model, LIVE_ADAPTER), EngineConfig(), threads=1)
    assert "no-such-model-anywhere" in str(failed.value)  # the child's traceback, in the parent
    # What crosses the pipe survives pickling: a request with its grammar, and the engine's errors
    # whole (a full replica's refusal keeps its retry hint, so the router tries another replica).
    constrained = replace(PROMPT, grammar=Grammar('{"grammars": []}', "test"))
    assert pickle.loads(pickle.dumps(constrained)) == constrained
    overloaded = pickle.loads(pickle.dumps(EngineOverloadedError("full", retry_after_s=3)))
    assert isinstance(overloaded, EngineOverloadedError) and overloaded.retry_after_s == 3


def test_the_replica_mode_is_a_checked_option() -> None:
    assert TorchServing().replica_processes  # processes unless asked otherwise
    assert not serving_config("torch", [], replicas=2, replica_processes=False).replica_processes  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="replica_processes"):
        TorchServing(replica_processes="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="torch engine"):
        serving_config("vllm", [], replica_processes=True)
