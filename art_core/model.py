"""`Model` and `TrainableModel`: the user's handles on a served model (ART's names, shape and pydantic).

`Model` is a model we do not train (a prompted or hosted model used as a baseline, an opponent
or a judge): it only knows where it is served. `TrainableModel` is a LoRA on `base_model` that a
backend trains and serves. Both are pydantic models generic over a user `config` (any
JSON-serialisable value, usually a pydantic model), which rollouts read as `model.config`, which
`model_copy`/`model_dump` handle with pydantic's semantics, and which is persisted with the model
(`model.json`).

They are pydantic, not frozen dataclasses like our configs, because ART scripts rely on pydantic's
behaviour (`TrainableModel[Cfg]`, `model_copy(deep=True)` then edit `name` and `config`,
`model_dump`) and because the model's description crosses process boundaries. The connection to a
backend (backend, clients) is runtime state, not a field: a copy is never registered.

It also holds `Backend`, the protocol these models call: a backend gets `model.spec` to
register and the model's name for everything else, so backends never name these classes. Light:
no torch or transformers at import (a `RemoteBackend` client stays small). Left out: capture (the
rollout scope is `integrations.scope`; the request hooks are `art_core.capture`) and the wire
records (`art_core.host.records`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import to_json
from typing_extensions import TypeVar

from art_core.capture import active_rollout, request_hook, rollout_base_url, server_root
from art_core.host.records import (
    InferenceInfo,
    ModelRef,
    ModelSpec,
    ProgressCallback,
    TrainResult,
    lora_from_flat_fields,
)
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.summary import split_metrics
from art_core.storage import ModelStorage, served_name, validate_name
from art_core.training.art_args import apply_art_args
from art_core.training.config import LoRAConfig, TrainConfig

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT", default=Any)
"""The type of a model's user `config`; unparametrised (`TrainableModel(...)`) it is `Any`."""


class Backend(Protocol):
    """What a `TrainableModel` needs from a backend, by the model's name (`LocalBackend` in-process,
    `RemoteBackend` over HTTP). Defined here, by its one caller, so backends never name the model.
    Backends also take a model object where ART scripts pass one (`backend.train(model, ...)`): any
    `ModelRef` (`art_core.host.records`) is read by its `name`."""

    async def register(self, spec: ModelSpec) -> InferenceInfo: ...

    async def train(
        self,
        model: ModelRef,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
        **art_kwargs: Any,
    ) -> TrainResult:
        """One step; `config=None` with ART 0.5's keyword arguments (`learning_rate=...`) also works."""
        ...

    async def get_step(self, model: ModelRef) -> int: ...

    async def list_checkpoints(self, model: ModelRef) -> list[int]: ...

    async def delete_checkpoints(self, model: ModelRef, keep: Iterable[int]) -> list[int]: ...

    async def history(self, model: ModelRef) -> list[dict[str, float]]: ...

    async def close(self) -> None: ...


class NotRegisteredError(RuntimeError):
    """The model was used before `await model.register(backend)`."""


class _Runtime:
    """A model's connection to its backend: never copied (a copy of a model starts unregistered)."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.info: InferenceInfo | None = None
        self.client: Any = None
        self.sync_client: Any = None

    def __copy__(self) -> _Runtime:
        return _Runtime()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Runtime:
        return _Runtime()


def _check_json(config: Any) -> None:
    try:
        to_json(config)
    except Exception as exc:
        raise ValueError(
            f"the model config ({type(config).__name__}) cannot be serialised to JSON ({exc}); "
            "use JSON-friendly values (a pydantic model, dataclass, dict, str, number...)"
        ) from exc


class Model(BaseModel, Generic[ConfigT]):
    """A model served somewhere that we do not train; ART's `art.Model`.

    ```python
    judge = Model(name="gpt-4.1", project="demo", inference_base_url="https://api.openai.com/v1",
                  inference_api_key=os.environ["OPENAI_API_KEY"])
    reply = await judge.openai_client().chat.completions.create(model=judge.get_inference_name(), ...)
    ```
    """

    model_config = ConfigDict(validate_assignment=True, extra="forbid", protected_namespaces=())

    name: str
    """The model's name (also the served name, unless `inference_model_name` is set)."""
    project: str
    """The project it belongs to; names the folder of its logs."""
    entity: str | None = None
    """ART's W&B entity; kept for compatibility, unused here."""
    id: str | None = None
    """ART's W&B run id; kept for compatibility, unused here."""
    run_id: str | None = None
    """ART's run id; kept for compatibility, unused here."""
    config: ConfigT | None = None
    """The user's config (JSON-serialisable), read by rollouts as `model.config`."""
    trainable: bool = False
    """False for a `Model`, True for a `TrainableModel` (ART's discriminator)."""
    inference_api_key: str | None = Field(default=None, repr=False)
    """Bearer key of the inference endpoint."""
    inference_base_url: str | None = None
    """OpenAI-compatible base URL of the inference endpoint."""
    inference_model_name: str | None = None
    """The name to send to the endpoint, when it is not `name`."""
    base_path: str = ".art"
    """Where `log` writes when no local backend holds the model's folder."""

    _runtime: _Runtime = PrivateAttr(default_factory=_Runtime)

    @field_validator("name", "project")
    @classmethod
    def _valid_name(cls, value: str, info: Any) -> str:
        return validate_name(value, "model name" if info.field_name == "name" else "project")

    @model_validator(mode="after")
    def _json_config(self) -> Model[ConfigT]:
        _check_json(self.config)
        return self

    def __copy__(self) -> Model[ConfigT]:
        copied = super().__copy__()
        copied._runtime = _Runtime()
        return copied

    async def register(self, backend: Backend) -> None:
        """Remember `backend` (ART's call; a model we do not train loads nothing)."""
        _check_json(self.config)
        self._runtime.backend = backend

    def get_inference_name(self, step: int | None = None) -> str:
        """The name to send to the endpoint; `name@step` for a checkpoint (ART's convention)."""
        name = self.inference_model_name or self.name
        return served_name(name, step)

    def _endpoint(self) -> tuple[str, str]:
        if self.inference_base_url is None or self.inference_api_key is None:
            raise ValueError(
                f"{self.name!r} has no endpoint: set inference_base_url and inference_api_key to make a client"
            )
        return self.inference_base_url, self.inference_api_key

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` for the endpoint (cached; 1200 s timeout, no client retries)."""
        if self._runtime.client is None:
            from openai import AsyncOpenAI

            base_url, api_key = self._endpoint()
            self._runtime.client = AsyncOpenAI(
                base_url=base_url, api_key=api_key, timeout=1200, max_retries=0
            )
        return self._runtime.client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.completion`/`acompletion` (ART's: name, endpoint, temperature 1)."""
        params: dict[str, Any] = {"model": self.get_inference_name(step), "temperature": 1.0}
        if self.inference_base_url is not None:
            params["api_base"] = self.inference_base_url
        if self.inference_api_key is not None:
            params["api_key"] = self.inference_api_key
        return params

    async def get_step(self) -> int:
        """0: a model we do not train has no steps (as in ART)."""
        return 0

    def _log_storage(self) -> ModelStorage:
        path = getattr(self._runtime.backend, "path", None)
        return ModelStorage.create(path if path is not None else self.base_path, self.project, self.name)

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record `split`'s groups (trajectories file + summary metrics) and/or `metrics` at `step`.

        Writes `trajectories/<split>/<step:04d>.jsonl` and one history.jsonl line (`{split}/reward`,
        ...); keys of `metrics` without a `/` get the `{split}/` prefix. Returns what it wrote.
        A metrics record already in history for that step (e.g. a train result) is not repeated.
        """
        validate_name(split, "split name")
        current = await self.get_step()  # waits for a commit in flight: its history line is then there
        step = current if step is None else step
        storage = self._log_storage()
        groups = None if trajectories is None else list(trajectories)
        if groups is not None and self._skip_train_split(split):
            groups = None
        extra = {k: float(v) for k, v in (metrics or {}).items()}
        if extra and _already_logged(storage.read_history(), step, extra):
            extra = {}
        record: dict[str, float] = {}
        if groups is not None:
            storage.write_trajectories(split, step, groups)
            record.update(split_metrics(groups, split))
        record.update({(k if "/" in k else f"{split}/{k}"): v for k, v in extra.items() if k != "step"})
        if record:
            storage.append_history({"step": step, **record})
            hook = getattr(self._runtime.backend, "record_logged", None)
            if hook is not None:  # LocalBackend: the model's W&B / Langfuse sinks
                hook(self, split, step, {"step": step, **record}, groups or [])
        return record

    def _skip_train_split(self, split: str) -> bool:
        return False


class TrainableModel(Model[ConfigT], Generic[ConfigT]):
    """A LoRA on top of `base_model`, served for rollouts and trained on their trajectories.

    ```python
    model = TrainableModel(project="demo", name="agent-001", base_model="smollm2-135m")
    await model.register(LocalBackend())
    client = model.openai_client()
    ...
    result = await model.train(groups, config=TrainConfig(learning_rate=1e-5))
    ```

    ART's `_internal_config={"peft_args": {"r": 16, "lora_alpha": 32}}` sets `lora_rank` and
    `lora_alpha`; any other key raises (configure serving on the backend instead).
    """

    base_model: str
    """A base model id (see the README's Models section), e.g. "smollm2-135m" or "tiny-random"."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """The adapter's shape (rank, alpha, dropout, target modules, seed); `lora_rank`/`lora_alpha`
    (the flat spelling, also accepted by the constructor and `_internal_config`) read its `r`/`alpha`."""
    trust_remote_code: bool = False
    """Let transformers run code shipped with the base model; off unless you trust it."""
    trainable: bool = True
    """True (ART's discriminator)."""

    def __init__(self, /, _internal_config: Mapping[str, Any] | None = None, **data: Any) -> None:
        if _internal_config is not None:
            data.update(_lora_from_internal_config(_internal_config))
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _flat_lora_fields(cls, data: Any) -> Any:
        """`lora_rank=` / `lora_alpha=` (and `_internal_config`'s peft_args) mapped into `lora`."""
        return lora_from_flat_fields(data)

    def __repr__(self) -> str:
        return f"TrainableModel(project={self.project!r}, name={self.name!r}, base_model={self.base_model!r})"

    async def register(
        self, backend: Backend, _openai_client_config: Mapping[str, Any] | None = None
    ) -> None:
        """Load the model on `backend` (resuming from its latest checkpoint) and start serving it."""
        if _openai_client_config is not None:
            raise ValueError(
                "_openai_client_config (ART's vLLM server options) is not supported: configure serving "
                "on the backend, e.g. LocalBackend(serving=VLLMServing(vllm=VLLMEngineConfig(...))) or `art serve` flags"
            )
        _check_json(self.config)
        info = await backend.register(self.spec)
        self._runtime = _Runtime()
        self._runtime.backend, self._runtime.info = backend, info
        self.inference_base_url, self.inference_api_key = info.base_url, info.api_key
        self.inference_model_name = info.model_name

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
        """What a backend registers: the project, name, base model, LoRA shape and user config."""
        return ModelSpec(
            project=self.project,
            name=self.name,
            base_model=self.base_model,
            lora=self.lora,
            trust_remote_code=self.trust_remote_code,
            config=self.model_dump(mode="json", include={"config"})["config"],
        )

    @property
    def backend(self) -> Backend:
        if self._runtime.backend is None:
            raise NotRegisteredError(
                f"{self!r} is not registered: call `await model.register(backend)` first"
            )
        return self._runtime.backend  # type: ignore[no-any-return]

    @property
    def inference(self) -> InferenceInfo:
        if self._runtime.info is None:
            raise NotRegisteredError(
                f"{self!r} is not registered: call `await model.register(backend)` first"
            )
        return self._runtime.info

    def get_inference_name(self, step: int | None = None) -> str:
        """`name` serves the latest weights; `name@step` a given checkpoint."""
        return served_name(self.name, step)

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` pointed at our server (cached).

        Inside a rollout scope (`integrations.scope.rollout`) on this model's server its requests
        carry the rollout's `X-Rollout-Id` header (`art_core.capture.tag_request`), so the server
        records them into that rollout.
        """
        if self._runtime.client is None:
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            info = self.inference
            http_client = DefaultAsyncHttpxClient(event_hooks={"request": [request_hook(is_async=True)]})
            self._runtime.client = AsyncOpenAI(
                base_url=info.base_url,
                api_key=info.api_key,
                timeout=1200,
                max_retries=0,
                http_client=http_client,
            )
        return self._runtime.client

    def sync_openai_client(self) -> Any:
        """An `openai.OpenAI` (blocking) pointed at our server (cached); captured like `openai_client()`.

        A thread sees the rollout scope when it runs in a copy of the caller's context
        (`asyncio.to_thread` does this; `loop.run_in_executor` and bare threads do not).
        """
        if self._runtime.sync_client is None:
            from openai import DefaultHttpxClient, OpenAI

            info = self.inference
            http_client = DefaultHttpxClient(event_hooks={"request": [request_hook(is_async=False)]})
            self._runtime.sync_client = OpenAI(
                base_url=info.base_url,
                api_key=info.api_key,
                timeout=1200,
                max_retries=0,
                http_client=http_client,
            )
        return self._runtime.sync_client

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
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult:
        """One GRPO step on `groups`; the server serves the new LoRA as soon as it returns.

        `_config` takes ART's `dev.TrainConfig` knobs (mapped by `art_core.training.art_args`);
        `verbose` logs the result at INFO level.
        """
        config = config or TrainConfig()
        if _config:
            config = apply_art_args(config, _config, where="TrainableModel.train(_config=...)")
        result = await self.backend.train(self.name, list(groups), config, on_progress=on_progress)
        if not result.trained:
            logger.warning(
                "step %d: %s", result.step, result.warnings[0] if result.warnings else "nothing trained"
            )
        elif verbose:
            logger.info("step %d trained: %s", result.step, result.metrics)
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

    def _skip_train_split(self, split: str) -> bool:
        if split != "train":
            return False
        logger.info(
            "model.log(groups, split='train'): train() stores the trained groups and their metrics "
            "itself, so these groups are not logged again (metrics=... still is)"
        )
        return True

    def _log_storage(self) -> ModelStorage:
        path = getattr(self._runtime.backend, "path", None)
        if path is None and self._runtime.backend is not None:
            logger.info("%r: the backend keeps no local folder; logging under %s", self, self.base_path)
        return ModelStorage.create(path if path is not None else self.base_path, self.project, self.name)


def _already_logged(history: list[dict[str, Any]], step: int, metrics: Mapping[str, float]) -> bool:
    """Whether a history record of `step` already holds every one of `metrics` (NaN is stored as null)."""

    def same(stored: Any, value: float) -> bool:
        return stored == value or (stored is None and math.isnan(value))

    return any(
        h.get("step") == step and all(k in h and same(h[k], v) for k, v in metrics.items()) for h in history
    )


_PEFT_KEYS = {"r": "lora_rank", "lora_alpha": "lora_alpha"}


def _lora_from_internal_config(internal: Mapping[str, Any]) -> dict[str, Any]:
    """Our fields from ART's `_internal_config` (dev.InternalModelConfig); unsupported keys raise."""
    out: dict[str, Any] = {}
    for section, values in internal.items():
        if section != "peft_args":
            raise ValueError(
                f"_internal_config[{section!r}] is not supported: only peft_args r/lora_alpha map here "
                "(set engine options on the backend: LocalBackend(serving=TorchServing(...) or VLLMServing(...)))"
            )
        for key, value in dict(values).items():
            if key not in _PEFT_KEYS:
                raise ValueError(
                    f"_internal_config['peft_args'][{key!r}] is not supported; only r and lora_alpha are"
                )
            out[_PEFT_KEYS[key]] = value
    return out
