"""`art serve` in a real subprocess on 127.0.0.1, driven by `RemoteBackend` and the `openai` client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from art_core.app import free_port, wait_healthy
from art_core.backends.remote import (
    RemoteAuthenticationError,
    RemoteBackend,
    RemoteBadRequestError,
    RemoteError,
    RemoteNotFoundError,
    RemoteRequestTooLargeError,
    RemoteUnavailableError,
    encode_train_request,
)
from art_core.host import routes as training_api
from art_core.host.service import ModelService
from art_core.model import TrainableModel
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.server.app import serve_in_thread
from art_core.training.config import TrainConfig

KEY = "test-key-0123456789"
MAX_BODY_MIB = 1
"""The server's `--max-body-mib` (its default, 128, would make the oversized upload slow to build)."""
MESSAGES: Any = [{"role": "user", "content": "Name a fruit."}]
STARTUP_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ART_API_KEY", None)
    return env


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; the process is reaped either way."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("art_serve")
    port = free_port()
    log = folder / "server.log"
    command = [sys.executable, "-m", "art_core.app.cli", "serve", "--port", str(port), "--api-key", KEY]
    command += ["--path", str(folder / ".art"), "--log-level", "warning", "--max-body-mib", str(MAX_BODY_MIB)]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=_server_env())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log, api_key=KEY, timeout_s=STARTUP_TIMEOUT_S)
        yield Server(url, process, log)
    finally:
        stop_process(process, timeout_s=15)


async def registered(server: Server, name: str) -> tuple[TrainableModel, RemoteBackend]:
    backend = RemoteBackend(server.url, api_key=KEY)
    model = TrainableModel(project="remote", name=name, base_model="tiny-random")
    await model.register(backend)
    return model, backend


async def sampled_groups(model: TrainableModel, n_groups: int = 2, size: int = 4) -> list[TrajectoryGroup]:
    """`n_groups` groups of `size` real completions from the server, with varied rewards."""
    client = model.openai_client()
    groups = []
    for g in range(n_groups):
        messages = [{"role": "user", "content": f"Name fruit number {g}."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=6, n=size, temperature=1.0
        )
        trajectories = [
            Trajectory(messages_and_choices=[*messages, choice], reward=i / (size - 1))
            for i, choice in enumerate(completion.choices)
        ]
        assert all(t.turns for t in trajectories), "every choice must carry the server's token record"
        groups.append(TrajectoryGroup(trajectories))
    return groups


async def test_register_chat_train_step_history_and_checkpoints(server: Server) -> None:
    model, backend = await registered(server, "agent-main")
    async with backend:
        assert model.inference_base_url == server.url + "/v1"
        client = model.openai_client()
        completion = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=5)
        fields = completion.choices[0].model_extra or {}
        assert fields["prompt_token_ids"] and fields["token_ids"]
        assert len(fields["token_logprobs"]) == len(fields["token_ids"])
        assert await model.get_step() == 0
        assert await model.list_checkpoints() == [0]

        phases: list[tuple[str, dict[str, float]]] = []
        groups = await sampled_groups(model)
        result = await model.train(
            groups,
            TrainConfig(learning_rate=1e-3),
            on_progress=lambda phase, metrics: phases.append((phase, metrics)),
        )
        assert [p for p, _ in phases] == ["prepare", "train", "checkpoint", "done"]
        assert phases[0][1]["groups_total"] == 2.0
        assert result.step == 1 and result.trained, result.warnings
        assert result.metrics["step"] == 1.0
        assert await model.get_step() == 1
        history = await model.history()
        assert len(history) == 1 and history[0]["step"] == 1
        assert history[0]["train/reward"] == pytest.approx(0.5)
        assert await model.list_checkpoints() == [0, 1]

        for served in (model.get_inference_name(1), model.get_inference_name(0)):
            reply = await client.chat.completions.create(model=served, messages=MESSAGES, max_tokens=3)
            assert (reply.choices[0].model_extra or {})["served_model"] == served

        second = await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-3))
        assert second.step == 2
        assert await backend.delete_checkpoints(model.name, keep=[1]) == [0]  # the latest (2) is always kept
        assert await model.list_checkpoints() == [1, 2]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=model.get_inference_name(0), messages=MESSAGES)


async def test_wrong_api_key_is_401_on_training_and_openai_routes(server: Server) -> None:
    model, backend = await registered(server, "agent-auth")
    await backend.close()
    for key in ("wrong-key", None):
        intruder = RemoteBackend(server.url, api_key=key or "")
        async with intruder:
            with pytest.raises(RemoteAuthenticationError) as caught:
                await intruder.get_step(model.name)
            assert caught.value.status == 401 and "API key" in caught.value.message
            with pytest.raises(RemoteAuthenticationError):
                await intruder.register(model.spec)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()
    response = httpx.post(server.url + "/v1/art/models/agent-auth/train", json={"groups": []})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_an_upload_over_max_body_mib_is_413(server: Server) -> None:
    model, backend = await registered(server, "agent-big")
    text = "fruit " * (MAX_BODY_MIB * 2**20 // 6 + 1)
    big = Trajectory(messages=[{"role": "user", "content": text}], reward=1.0)
    async with backend:
        with pytest.raises(RemoteRequestTooLargeError) as caught:
            await backend.train(model.name, [TrajectoryGroup([big, big])], TrainConfig())
        assert caught.value.status == 413 and f"limit of {MAX_BODY_MIB * 2**20} bytes" in caught.value.message
        assert await backend.get_step(model.name) == 0


async def test_unknown_model_is_404(server: Server) -> None:
    ghost = TrainableModel(project="remote", name="never-registered", base_model="tiny-random")
    async with RemoteBackend(server.url, api_key=KEY) as backend:
        for call in (backend.get_step, backend.list_checkpoints, backend.history):
            with pytest.raises(RemoteNotFoundError, match="never-registered"):
                await call(ghost.name)
        with pytest.raises(RemoteNotFoundError):
            await backend.train(ghost.name, [], TrainConfig())
        with pytest.raises(RemoteNotFoundError):
            await backend.delete_checkpoints(ghost.name, keep=[])


async def test_bad_train_config_is_400_with_the_reason(server: Server) -> None:
    model, backend = await registered(server, "agent-config")
    await backend.close()
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{server.url}/v1/art/models/{model.name}/train"
    config = dataclasses.asdict(TrainConfig())
    cases = [
        ({**config, "learning_rate": -1}, "learning_rate must be a positive finite number"),
        ({"loss": {"name": "ppo"}}, "unknown loss name 'ppo'"),
        ({"learning_rte": 1e-4}, "unknown TrainConfig field(s) ['learning_rte']"),
    ]
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        for bad, reason in cases:
            response = await http.post(url, json={"groups": [], "config": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert reason in error["message"] and error["param"] == "config"
        response = await http.post(url, json={"groups": "not a list"})
        assert response.status_code == 400 and "groups" in response.json()["error"]["message"]
    async with RemoteBackend(server.url, api_key=KEY) as backend:
        assert await backend.get_step(model.name) == 0


async def test_non_finite_reward_is_400_and_trains_nothing(server: Server) -> None:
    model, backend = await registered(server, "agent-reward")
    async with backend:
        groups = await sampled_groups(model, n_groups=1, size=2)
        groups[0].trajectories[1].reward = math.inf
        with pytest.raises(RemoteBadRequestError) as caught:
            await model.train(groups, TrainConfig())
        assert caught.value.status == 400
        assert "group 0, trajectory 1" in caught.value.message and "finite" in caught.value.message
        groups[0].trajectories[1].reward = None
        with pytest.raises(RemoteBadRequestError, match="has no reward"):
            await model.train(groups, TrainConfig())
        assert await model.get_step() == 0
        assert await model.list_checkpoints() == [0]


async def test_two_models_on_one_server_train_side_by_side(server: Server) -> None:
    (first, b1), (second, b2) = await registered(server, "agent-a"), await registered(server, "agent-b")
    async with b1, b2:
        groups_1, groups_2 = await sampled_groups(first), await sampled_groups(second)
        results = await asyncio.gather(first.train(groups_1), second.train(groups_2))
        assert [r.step for r in results] == [1, 1] and all(r.trained for r in results)
        assert await first.get_step() == 1 and await second.get_step() == 1
        names = {m.id for m in (await first.openai_client().models.list()).data}
        assert {"agent-a", "agent-a@1", "agent-b", "agent-b@1"} <= names


async def test_registering_a_missing_base_model_is_400(server: Server) -> None:
    model = TrainableModel(project="remote", name="agent-missing", base_model="no/such-model-anywhere")
    async with RemoteBackend(server.url, api_key=KEY) as backend:
        with pytest.raises(RemoteBadRequestError) as caught:
            await model.register(backend)
    assert caught.value.param == "base_model"


async def test_unreachable_server_is_a_clear_connection_error() -> None:
    model = TrainableModel(project="remote", name="agent-x", base_model="tiny-random")
    async with RemoteBackend(f"http://127.0.0.1:{free_port()}/v1/", api_key=KEY, timeout=5) as backend:
        with pytest.raises(RemoteUnavailableError, match="is `art serve` running"):
            await backend.get_step(model.name)


def test_serve_refuses_a_public_host_without_a_key() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "art_core.app.cli", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True,
        text=True,
        env=_server_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert "refusing to listen on '0.0.0.0' without an API key" in done.stderr
    assert time.monotonic() - started < 20  # it fails before loading torch or binding


def test_stream_without_a_final_line_or_with_an_error_line_raises() -> None:
    from art_core.backends.remote import _handle_line

    seen: list[str] = []
    assert (
        _handle_line(json.dumps({"phase": "prepare", "metrics": {"x": 1.0}}), lambda p, m: seen.append(p))
        is None
    )
    assert _handle_line(json.dumps({"heartbeat": 15.0}), None) is None
    assert seen == ["prepare"]
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}, "status": 500}
    with pytest.raises(RemoteError, match="500: boom") as caught:
        _handle_line(json.dumps(error), None)
    assert type(caught.value) is RemoteError
    result = _handle_line(
        json.dumps({"result": {"step": 3, "trained": True, "metrics": {"loss": math.nan}}}), None
    )
    assert result is not None and result.step == 3 and math.isnan(result.metrics["loss"])


def test_train_request_keeps_non_finite_rewards_visible() -> None:
    group = TrajectoryGroup([Trajectory(messages=MESSAGES, reward=math.inf)])
    body = json.loads(encode_train_request([group], TrainConfig(learning_rate=1e-4)))
    assert body["groups"][0]["trajectories"][0]["reward"] == math.inf
    assert body["config"]["learning_rate"] == 1e-4 and body["config"]["loss"]["name"] == "grpo"


class FailingService(ModelService):
    """The real service with a step that reports progress, stays silent a while, then fails."""

    async def train(
        self,
        name: str,
        groups: Any,
        config: TrainConfig,
        on_progress: Any = None,
        request_key: Any = None,
        **options: Any,
    ) -> Any:
        self.get(name)

        def step() -> None:
            on_progress("prepare", {"groups_total": 1.0})
            time.sleep(0.3)
            raise RuntimeError("disk full while writing the checkpoint")

        return await asyncio.to_thread(step)


async def test_a_failure_mid_step_ends_the_stream_with_an_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training_api, "HEARTBEAT_S", 0.05)
    service = FailingService(tmp_path)
    handle = serve_in_thread(training_api.create_server_app(service, api_key=KEY))
    try:
        model = TrainableModel(project="remote", name="agent-fails", base_model="tiny-random")
        async with RemoteBackend(handle.url, api_key=KEY) as backend:
            await model.register(backend)
            body: dict[str, Any] = {"groups": [], "config": {}}
            headers = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=handle.url, headers=headers) as http:
                async with http.stream("POST", "/v1/art/models/agent-fails/train", json=body) as response:
                    assert response.status_code == 200
                    lines = [json.loads(line) async for line in response.aiter_lines() if line]
            assert lines[0] == {"phase": "prepare", "metrics": {"groups_total": 1.0}}
            assert any("heartbeat" in line for line in lines[1:-1])
            assert lines[-1]["status"] == 500 and "disk full" in lines[-1]["error"]["message"]
            phases: list[str] = []
            with pytest.raises(RemoteError, match="disk full") as caught:
                await model.train([], on_progress=lambda phase, _: phases.append(phase))
            assert caught.value.status == 500 and phases == ["prepare"]
    finally:
        handle.stop()
        service.close()
