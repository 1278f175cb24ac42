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
from typing import Any

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

    @model_validator(mode="before")
    @classmethod
    def _flat_lora_fields(cls, data: Any) -> Any:
        """ART's flat `lora_rank` / `lora_alpha` (and older clients' bodies) mapped into `lora`, once."""
        if not isinstance(data, dict) or not ({"lora_rank", "lora_alpha"} & data.keys()):
            return data
        data = dict(data)
        if "lora" in data:
            raise ValueError("give the LoRA shape either as `lora` or as lora_rank/lora_alpha, not both")
        flat = {"r": data.pop("lora_rank", None), "alpha": data.pop("lora_alpha", None)}
        data["lora"] = {k: v for k, v in flat.items() if v is not None}  # validated as a LoRAConfig
        return data


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
"""Called with a phase name (`prepare`, `train`, `checkpoint`, `done`) and metrics so far."""


__all__ = ["WIRE_PREFIX", "InferenceInfo", "ModelSpec", "ProgressCallback", "TrainResult"]
