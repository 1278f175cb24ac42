"""ART's backend surface beside ours: the 0.5 `backend.train(model, groups, learning_rate=...)`
call, `LocalTrainResult`, and clear errors for what we do not offer.

`ArtBackendMixin` gives a backend the ART methods we do not implement (`train_sft`, the private
`_experimental_*` S3 / deploy helpers); each raises `NotSupportedError` saying what to use instead.
`ServerlessBackend` / `ServerlessTrainResult` (W&B serverless training) raise the same on use.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from art_core.host.records import TrainResult
from art_core.rollouts.unsupported import NotSupportedError
from art_core.training.art_args import ART_05_DEFAULTS, apply_art_args
from art_core.training.config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSFTConfig:
    """ART 0.5's supervised fine-tuning options. SFT is not implemented: `train_sft` raises."""

    learning_rate: float | list[float] = 5e-5
    """One learning rate, or one per batch."""
    batch_size: int | Literal["auto"] = "auto"
    """Trajectories per optimizer step, or "auto"."""

    def __post_init__(self) -> None:
        rates = self.learning_rate if isinstance(self.learning_rate, list) else [self.learning_rate]
        if not all(math.isfinite(r) and r > 0 for r in rates):
            raise ValueError(f"learning_rate must be positive and finite, got {self.learning_rate}")
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be an int >= 1 or 'auto', got {self.batch_size!r}")


class LocalTrainResult(TrainResult):
    """ART 0.5's result of `LocalBackend.train`: a `TrainResult` plus the step's checkpoint folder."""

    checkpoint_path: str | None = None
    """The folder of the checkpoint this step wrote; written in the background by default
    (`TorchServing.overlap_checkpoint`): complete once the next `train`, `get_step`, `history` or
    `close` returned."""


def resolve_train_config(
    config: TrainConfig | None, art_kwargs: Mapping[str, Any], *, where: str
) -> tuple[TrainConfig, bool]:
    """The `TrainConfig` of a train call, and whether ART's `verbose` was set.

    `config` given: ART keyword arguments adjust it. No `config` (the 0.5 style): they adjust ART
    0.5's defaults (the CISPO loss; our other defaults).
    """
    kwargs = dict(art_kwargs)
    verbose = bool(kwargs.get("verbose", False))
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(
            f"{where}: config must be a TrainConfig, got {type(config).__name__}; "
            "ART 0.5's options are keyword arguments: backend.train(model, groups, learning_rate=...)"
        )
    base = config if config is not None else ART_05_DEFAULTS
    return (apply_art_args(base, kwargs, where=where) if kwargs else base), verbose


def log_result(result: TrainResult, verbose: bool) -> None:
    if not result.trained:
        logger.warning(
            "step %d: %s", result.step, result.warnings[0] if result.warnings else "nothing trained"
        )
    elif verbose:
        logger.info("step %d trained: %s", result.step, result.metrics)


def _unsupported(what: str, instead: str) -> NoReturn:
    raise NotSupportedError(f"{what} is not supported here; {instead}")


class ArtBackendMixin:
    """ART backend methods we do not implement, each failing loudly with what to do instead."""

    async def train_sft(self, model: Any, trajectories: Any, config: Any = None, **kwargs: Any) -> NoReturn:
        _unsupported("supervised fine-tuning (train_sft)", "only RL steps are implemented: backend.train")

    async def _experimental_pull_from_s3(self, model: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "_experimental_pull_from_s3", "copy the model folder `.art/<project>/models/<name>/` yourself"
        )

    async def _experimental_push_to_s3(self, model: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "_experimental_push_to_s3", "copy the model folder `.art/<project>/models/<name>/` yourself"
        )

    async def _experimental_fork_checkpoint(self, model: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("_experimental_fork_checkpoint", "copy a `checkpoints/<step>` folder into the new model")

    async def _experimental_deploy(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "_experimental_deploy", "serve checkpoints with `art serve` (or vLLM with the LoRA folder)"
        )


class ServerlessBackend:
    """ART's W&B serverless backend: not supported (training runs on your machine or `art serve`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported(
            "W&B serverless training (ServerlessBackend)", "use LocalBackend() or RemoteBackend(url)"
        )


class ServerlessTrainResult:
    """ART's result of serverless training: not supported (see `ServerlessBackend`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported(
            "W&B serverless training (ServerlessTrainResult)", "use LocalBackend() or RemoteBackend(url)"
        )
