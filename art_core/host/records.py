"""The records the host exchanges with every backend and client: pydantic, no torch.

`ModelSpec` (what a client registers), `InferenceInfo` (where a registered model is served),
`TrainResult` (what one step did), `ProgressCallback` (the phases of a step) and `WIRE_PREFIX`
(the path of the training routes). They cross the HTTP boundary between `RemoteBackend` and
`art serve`, and the in-process one between `LocalBackend` and `ModelService`, so each is
defined once here, below both. Left out: the routes themselves (`host.routes`) and the
`Backend` protocol (`art_core.model`, defined by its caller).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, Field, model_validator

from art_core.training.config import LoRAConfig

WIRE_PREFIX = "/v1/art/models"
"""Where `art serve` mounts its training routes (`host.routes`), and where `RemoteBackend` sends."""


class ModelSpec(BaseModel):
    """What a client registers: crosses the HTTP boundary, so pydantic (`TrainableModel.spec`)."""

    project: str
    name: str
    base_model: str
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """The adapter's shape (rank, alpha, dropout, target modules, seed); its defaults live there only."""
    trust_remote_code: bool = False
    config: Any = None
    """The model's user config as JSON values (`TrainableModel.config`), persisted in model.json."""

    @model_validator(mode="before")
    @classmethod
    def _flat_lora_fields(cls, data: Any) -> Any:
        return lora_from_flat_fields(data)


def lora_from_flat_fields(data: Any) -> Any:
    """ART's flat `lora_rank` / `lora_alpha` in a pydantic model's input mapped into its `lora`
    field (a mapping, validated as a `LoRAConfig`; LoRAConfig's defaults for what is not given);
    `data` unchanged without them. The one mapping of `ModelSpec` and `TrainableModel`."""
    if not isinstance(data, dict) or not ({"lora_rank", "lora_alpha"} & data.keys()):
        return data
    data = dict(data)
    if data.get("lora") is not None:
        raise ValueError(
            "give the LoRA shape either as lora=LoRAConfig(...) or as lora_rank/lora_alpha, not both"
        )
    flat = {"r": data.pop("lora_rank", None), "alpha": data.pop("lora_alpha", None)}
    data["lora"] = {k: v for k, v in flat.items() if v is not None}
    return data


class Named(Protocol):
    """Anything with a model's `name` (a `TrainableModel`, a `ModelSpec`)."""

    @property
    def name(self) -> str: ...


ModelRef = str | Named
"""How a backend is told which model: its name, or an object that has one (ART scripts pass the model)."""


def model_name(model: ModelRef) -> str:
    """The name of `model`: the string itself, or the object's `name`."""
    if isinstance(model, str):
        return model
    name = getattr(model, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"expected a model name or an object with a `name`, got {type(model).__name__}")
    return name


class InferenceInfo(BaseModel):
    """Where a registered model is served."""

    base_url: str
    """OpenAI-compatible base URL, ending in `/v1`."""
    api_key: str
    """Bearer key the server expects."""
    model_name: str
    """The served name of the latest weights; `name@step` selects a checkpoint."""


class TrainResult(BaseModel):
    """What one call to `train` did."""

    step: int
    """The model's step after this call; it advances even when nothing was trained."""
    trained: bool
    """False when no example could be trained on; `warnings` says why."""
    metrics: dict[str, float] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)


ProgressCallback = Callable[[str, dict[str, float]], None]
"""Called with a phase name (`prepare`, `train`, `checkpoint`, `done`) and metrics so far.

`checkpoint` (`{"step": n}`) says step n is on disk. With the background commit
(`TorchServing.overlap_checkpoint`, in-process calls) it comes after `done`, from the commit's
thread, once the write finished (possibly after `train` returned); otherwise before `done`."""


__all__ = [
    "WIRE_PREFIX",
    "InferenceInfo",
    "ModelSpec",
    "ProgressCallback",
    "TrainResult",
    "lora_from_flat_fields",
]
