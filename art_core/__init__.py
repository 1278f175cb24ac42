"""art_core: GRPO + LoRA training for LLM agents, served through an OpenAI-compatible endpoint.

Importing this package is cheap and has no side effects; heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trajectory": "art_core.rollouts.records",
    "TrajectoryGroup": "art_core.rollouts.records",
    "History": "art_core.rollouts.records",
    "Turn": "art_core.rollouts.records",
    "gather_trajectory_groups": "art_core.rollouts.groups",
    "gather_trajectories": "art_core.rollouts.groups",
    "iterate_dataset": "art_core.rollouts.dataset",
    "TrainConfig": "art_core.training.config",
    "LossConfig": "art_core.training.loss",
    "TrainableModel": "art_core.model",
    "TrainResult": "art_core.backends.base",
}

__all__ = [
    "History",
    "LossConfig",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "Turn",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
]

if TYPE_CHECKING:
    from art_core.backends.base import TrainResult
    from art_core.model import TrainableModel
    from art_core.rollouts.dataset import iterate_dataset
    from art_core.rollouts.groups import gather_trajectories, gather_trajectory_groups
    from art_core.rollouts.records import History, Trajectory, TrajectoryGroup, Turn
    from art_core.training.config import TrainConfig
    from art_core.training.loss import LossConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'art_core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
