"""`TrainableModel`: the user's handle on a model being trained (ART's names and shape).

Holds `TrainableModel` (register on a backend, the OpenAI/LiteLLM clients that reach it, train,
steps and checkpoints) and `Backend`, the protocol it calls: a backend gets `model.spec` to
register and `model.name` for everything else, so backends never see this class. Light: no torch
or transformers at import (a `RemoteBackend` client stays small). Left out: capture (the rollout
scope is `integrations.scope`; the request hooks are `art_core.capture`) and the wire records
(`art_core.host.records`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from art_core.capture import active_rollout, request_hook, rollout_base_url, server_root
from art_core.host.records import InferenceInfo, ModelSpec, ProgressCallback, TrainResult
from art_core.rollouts.groups import TrajectoryGroup
from art_core.storage import served_name, validate_name
from art_core.training.config import LoRAConfig, TrainConfig

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """What a `TrainableModel` needs from a backend, by the model's name (`LocalBackend` in-process,
    `RemoteBackend` over HTTP). Defined here, by its one caller, so backends never name the model."""

    async def register(self, spec: ModelSpec) -> InferenceInfo: ...

    async def train(
        self,
        name: str,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult: ...

    async def get_step(self, name: str) -> int: ...

    async def list_checkpoints(self, name: str) -> list[int]: ...

    async def delete_checkpoints(self, name: str, keep: Iterable[int]) -> list[int]: ...

    async def history(self, name: str) -> list[dict[str, float]]: ...

    async def close(self) -> None: ...


class NotRegisteredError(RuntimeError):
    """The model was used before `await model.register(backend)`."""


def _lora_config(lora: LoRAConfig | None, rank: int | None, alpha: int | None) -> LoRAConfig:
    """`lora`, or a LoRAConfig from ART's `lora_rank`/`lora_alpha` (its defaults for what is not given)."""
    if lora is not None and (rank is not None or alpha is not None):
        raise ValueError(
            "give the LoRA shape either as lora=LoRAConfig(...) or as lora_rank/lora_alpha, not both"
        )
    if lora is not None:
        return lora
    default = LoRAConfig()
    return replace(
        default, r=default.r if rank is None else rank, alpha=default.alpha if alpha is None else alpha
    )


class TrainableModel:
    """A LoRA on top of `base_model`, served for rollouts and trained on their trajectories.

    ```python
    model = TrainableModel(project="demo", name="agent-001", base_model="smollm2-135m")
    await model.register(LocalBackend())
    client = model.openai_client()
    ...
    result = await model.train(groups, config=TrainConfig(learning_rate=1e-5))
    ```
    """

    def __init__(
        self,
        *,
        name: str,
        project: str,
        base_model: str,
        lora: LoRAConfig | None = None,
        lora_rank: int | None = None,
        lora_alpha: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.name = validate_name(name, "model name")
        self.project = validate_name(project, "project")
        self.base_model = base_model
        self.lora = _lora_config(lora, lora_rank, lora_alpha)
        """The adapter's shape; `lora_rank`/`lora_alpha` (ART's spelling) set its `r`/`alpha`."""
        self.trust_remote_code = trust_remote_code
        self._backend: Backend | None = None
        self._info: InferenceInfo | None = None
        self._client: Any = None
        self._sync_client: Any = None

    def __repr__(self) -> str:
        return f"TrainableModel(project={self.project!r}, name={self.name!r}, base_model={self.base_model!r})"

    async def register(self, backend: Backend) -> None:
        """Load the model on `backend` (resuming from its latest checkpoint) and start serving it."""
        self._info = await backend.register(self.spec)
        self._backend = backend
        self._client = None
        self._sync_client = None

    @property
    def lora_rank(self) -> int:
        """ART's name for `lora.r`."""
        return self.lora.r

    @property
    def lora_alpha(self) -> int:
        """ART's name for `lora.alpha`."""
        return self.lora.alpha

    @property
    def spec(self) -> ModelSpec:
        """What a backend registers: the project, name, base model and LoRA shape."""
        return ModelSpec(
            project=self.project,
            name=self.name,
            base_model=self.base_model,
            lora=self.lora,
            trust_remote_code=self.trust_remote_code,
        )

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise NotRegisteredError(
                f"{self!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    @property
    def inference(self) -> InferenceInfo:
        if self._info is None:
            raise NotRegisteredError(
                f"{self!r} is not registered: call `await model.register(backend)` first"
            )
        return self._info

    @property
    def inference_base_url(self) -> str:
        return self.inference.base_url

    @property
    def inference_api_key(self) -> str:
        return self.inference.api_key

    def get_inference_name(self, step: int | None = None) -> str:
        """`name` serves the latest weights; `name@step` a given checkpoint."""
        return served_name(self.name, step)

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` pointed at our server (cached).

        Inside a rollout scope (`integrations.scope.rollout`) on this model's server its requests
        carry the rollout's `X-Rollout-Id` header (`art_core.capture.tag_request`), so the server
        records them into that rollout.
        """
        if self._client is None:
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            info = self.inference
            http_client = DefaultAsyncHttpxClient(event_hooks={"request": [request_hook(is_async=True)]})
            self._client = AsyncOpenAI(
                base_url=info.base_url,
                api_key=info.api_key,
                timeout=1200,
                max_retries=0,
                http_client=http_client,
            )
        return self._client

    def sync_openai_client(self) -> Any:
        """An `openai.OpenAI` (blocking) pointed at our server (cached); captured like `openai_client()`.

        A thread sees the rollout scope when it runs in a copy of the caller's context
        (`asyncio.to_thread` does this; `loop.run_in_executor` and bare threads do not).
        """
        if self._sync_client is None:
            from openai import DefaultHttpxClient, OpenAI

            info = self.inference
            http_client = DefaultHttpxClient(event_hooks={"request": [request_hook(is_async=False)]})
            self._sync_client = OpenAI(
                base_url=info.base_url,
                api_key=info.api_key,
                timeout=1200,
                max_retries=0,
                http_client=http_client,
            )
        return self._sync_client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.completion`/`acompletion` that reach this model.

        Called inside a rollout scope on this model's server, `api_base` is the rollout-scoped
        URL, so the calls made with these params are recorded into that rollout.
        """
        info = self.inference
        api_base = info.base_url
        rollout = active_rollout()
        if rollout is not None and rollout.server_url == server_root(info.base_url):
            api_base = rollout_base_url(info.base_url, rollout.id)
        return {
            "model": f"openai/{self.get_inference_name(step)}",
            "api_base": api_base,
            "api_key": info.api_key,
            "temperature": 1.0,
        }

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult:
        """One GRPO step on `groups`; the server serves the new LoRA as soon as it returns."""
        result = await self.backend.train(
            self.name, list(groups), config or TrainConfig(), on_progress=on_progress
        )
        if not result.trained:
            logger.warning(
                "step %d: %s", result.step, result.warnings[0] if result.warnings else "nothing trained"
            )
        return result

    async def get_step(self) -> int:
        return await self.backend.get_step(self.name)

    async def history(self) -> list[dict[str, float]]:
        return await self.backend.history(self.name)

    async def list_checkpoints(self) -> list[int]:
        return await self.backend.list_checkpoints(self.name)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "train/reward") -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric`."""
        history = await self.history()
        scored = [
            (float(h[best_checkpoint_metric]), int(h["step"])) for h in history if best_checkpoint_metric in h
        ]
        keep = {await self.get_step()}
        if scored:
            keep.add(max(scored)[1])
        return await self.backend.delete_checkpoints(self.name, keep)
