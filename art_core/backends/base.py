"""What every backend does for a `TrainableModel`, and the records it returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, Field

from art_core.rollouts.records import TrajectoryGroup
from art_core.training.config import TrainConfig

if TYPE_CHECKING:
    from art_core.model import TrainableModel


class ModelSpec(BaseModel):
    """What a client registers: crosses the HTTP boundary, so pydantic."""

    project: str
    name: str
    base_model: str
    lora_rank: int = 8
    lora_alpha: int = 16
    trust_remote_code: bool = False

    @classmethod
    def from_model(cls, model: TrainableModel) -> ModelSpec:
        return cls(
            project=model.project,
            name=model.name,
            base_model=model.base_model,
            lora_rank=model.lora_rank,
            lora_alpha=model.lora_alpha,
            trust_remote_code=model.trust_remote_code,
        )


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


class Backend(Protocol):
    """Trains and serves models. `LocalBackend` in-process; `RemoteBackend` over HTTP."""

    async def register(self, model: TrainableModel) -> InferenceInfo: ...

    async def train(
        self,
        model: TrainableModel,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def list_checkpoints(self, model: TrainableModel) -> list[int]: ...

    async def delete_checkpoints(self, model: TrainableModel, keep: Iterable[int]) -> list[int]: ...

    async def history(self, model: TrainableModel) -> list[dict[str, float]]: ...

    async def close(self) -> None: ...
