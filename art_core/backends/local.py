"""`LocalBackend`: train and serve in this process, with the OpenAI server on a local port."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, overload

from art_core.backends.art_compat import ArtBackendMixin, LocalTrainResult, log_result, resolve_train_config
from art_core.capture import RolloutRecorder
from art_core.engine.config import EngineConfig
from art_core.host.records import InferenceInfo, ModelRef, ModelSpec, ProgressCallback, model_name
from art_core.host.service import ModelService
from art_core.host.serving import ServingConfig, TorchServing, VLLMServing
from art_core.host.sinks import ObserveConfig
from art_core.host.train_worker import FollowerExit, train_group_for
from art_core.rollouts.groups import TrajectoryGroup
from art_core.server.app import ServerHandle, create_app, serve_in_thread
from art_core.training.config import TrainConfig

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class LocalBackend(ArtBackendMixin):
    """Runs the engine, the trainer and an OpenAI-compatible server inside this process.

    The server binds 127.0.0.1 on a free port unless told otherwise. Bound anywhere else it
    refuses to start without an explicit `api_key`. On loopback a random key is made per
    backend; clients from `model.openai_client()` carry it.

    `serving` chooses the engine and carries its options: `TorchServing(engine_config=EngineConfig(...))`
    (the default) or `VLLMServing(vllm=VLLMEngineConfig(...))`, which serves with vLLM (each step's
    checkpoint hot-loaded) while the trainer trains here. `engine_config=EngineConfig(...)` is short
    for `serving=TorchServing(engine_config=...)`; it is one or the other.

    `train_procs=N` trains data-parallel on N processes (this one and N-1 it starts; one per GPU
    with vLLM, gloo ranks on CPU); see docs/distributed.md. Under torchrun the group is
    torchrun's: rank 0 runs the script, and on every other rank this constructor follows rank 0's
    training steps and exits the process (status 0) when rank 0 closes the backend, so the same
    script runs unchanged. `fsdp=True` (with `train_procs` N >= 2 or under torchrun, else
    `FSDPSetupError`) shards the base's frozen Linear layers over those processes with FSDP2; the
    torch engine then serves from a replica process with its own copy of the weights.

    `observe` chooses where steps go besides history.jsonl (W&B, Langfuse: on by default where
    installed and configured, see `ObserveConfig`).
    """

    @overload
    def __init__(
        self,
        path: Path | str = ".art",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        serving: ServingConfig | None = None,
        train_procs: int | None = None,
        fsdp: bool = False,
        observe: ObserveConfig | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        path: Path | str = ".art",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        engine_config: EngineConfig,
        train_procs: int | None = None,
        fsdp: bool = False,
        observe: ObserveConfig | None = None,
    ) -> None: ...

    def __init__(
        self,
        path: Path | str = ".art",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        serving: ServingConfig | None = None,
        engine_config: EngineConfig | None = None,
        train_procs: int | None = None,
        fsdp: bool = False,
        observe: ObserveConfig | None = None,
    ) -> None:
        if host not in LOOPBACK and not api_key:
            raise ValueError(
                f"refusing to serve on {host!r} without an api_key: pass api_key=... "
                "(or bind 127.0.0.1, the default)"
            )
        serving = _serving(serving, engine_config)
        cuda = isinstance(serving, VLLMServing) and serving.device().startswith("cuda")
        try:
            group = train_group_for(train_procs, cuda=cuda, fsdp=fsdp)
        except FollowerExit:
            raise SystemExit(0) from None
        try:
            self.service = ModelService(path, serving, train_group=group, observe=observe)
        except BaseException:
            if group is not None:  # its worker ranks wait for rank 0: let them go
                group.close()
            raise
        self.host, self.port = host, port
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.recorder = RolloutRecorder()
        """Records of chat completions made inside rollout scopes, until the scopes fetch them."""
        self._server: ServerHandle | None = None

    def _ensure_server(self) -> ServerHandle:
        if self._server is None:
            app = create_app(self.service, api_key=self.api_key, recorder=self.recorder)
            self._server = serve_in_thread(app, host=self.host, port=self.port)
        return self._server

    @property
    def path(self) -> Path:
        """The folder that holds every model's `<project>/models/<name>/`."""
        return self.service.base_path

    @property
    def base_url(self) -> str:
        return self._ensure_server().url + "/v1"

    async def register(self, spec: ModelSpec) -> InferenceInfo:
        await asyncio.to_thread(self.service.register, spec)
        server = self._ensure_server()
        return InferenceInfo(base_url=server.url + "/v1", api_key=self.api_key, model_name=spec.name)

    async def train(
        self,
        model: ModelRef,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
        **art_kwargs: Any,
    ) -> LocalTrainResult:
        """One step on `groups`: `train(model, groups, config)`, or ART 0.5's
        `train(model, groups, learning_rate=..., ...)` (see `art_core.training.art_args`)."""
        name = model_name(model)
        resolved, verbose = resolve_train_config(config, art_kwargs, where="LocalBackend.train")
        result = await self.service.train(name, list(groups), resolved, on_progress)
        if config is None:
            log_result(result, verbose)
        # With the background commit (the default) the checkpoint is complete once the next call
        # that reads the model's disk state (train, get_step, history, close) returned.
        checkpoint = self.service.get(name).storage.checkpoint_dir(result.step)
        return LocalTrainResult(**result.model_dump(), checkpoint_path=str(checkpoint))

    async def get_step(self, model: ModelRef) -> int:
        """The newest committed step (waits for a commit in flight)."""
        return (await asyncio.to_thread(self.service.committed, model_name(model))).step

    async def list_checkpoints(self, model: ModelRef) -> list[int]:
        return (await asyncio.to_thread(self.service.committed, model_name(model))).storage.steps()

    async def delete_checkpoints(self, model: ModelRef, keep: Iterable[int]) -> list[int]:
        return self.service.delete_checkpoints(model_name(model), keep)

    async def history(self, model: ModelRef) -> list[dict[str, float]]:
        hosted = await asyncio.to_thread(self.service.committed, model_name(model))
        return hosted.storage.read_history()

    def record_logged(
        self,
        model: ModelRef,
        split: str,
        step: int,
        metrics: dict[str, float],
        groups: Sequence[TrajectoryGroup],
    ) -> None:
        """`model.log` wrote a step to history.jsonl: send it to the model's sinks too."""
        self.service.record_logged(model_name(model), split, step, metrics, groups)

    async def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.service.close()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _serving(serving: ServingConfig | None, engine_config: EngineConfig | None) -> ServingConfig | None:
    """`serving`, or the `TorchServing` that the `engine_config=` shorthand stands for."""
    if engine_config is None:
        return serving
    if serving is not None:
        raise TypeError(
            "pass serving= or engine_config=, not both: TorchEngine's options go in "
            "serving=TorchServing(engine_config=EngineConfig(...)); vLLM's in VLLMServing(vllm=VLLMEngineConfig(...))"
        )
    return TorchServing(engine_config=engine_config)
