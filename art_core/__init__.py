"""art_core: GRPO + LoRA training for LLM agents, served through an OpenAI-compatible endpoint.

The user API (ART-compatible) is exported here. Importing this package is cheap and has no side
effects; heavy modules load on first use. The layers below it are sub-packages (rollouts, capture,
models, storage, training, engine, server, host, backends, app): see docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from art_core.host.records import TrainResult as TrainResult
    from art_core.model import TrainableModel as TrainableModel
    from art_core.rollouts.dataset import iterate_dataset as iterate_dataset
    from art_core.rollouts.groups import TrajectoryGroup as TrajectoryGroup
    from art_core.rollouts.groups import gather_trajectories as gather_trajectories
    from art_core.rollouts.groups import gather_trajectory_groups as gather_trajectory_groups
    from art_core.rollouts.records import History as History
    from art_core.rollouts.records import Trajectory as Trajectory
    from art_core.rollouts.records import Turn as Turn
    from art_core.training.config import LossConfig as LossConfig
    from art_core.training.config import TrainConfig as TrainConfig

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.rollouts.records": ("Trajectory", "History", "Turn"),
        "art_core.rollouts.groups": ("TrajectoryGroup", "gather_trajectory_groups", "gather_trajectories"),
        "art_core.rollouts.dataset": ("iterate_dataset",),
        "art_core.training.config": ("TrainConfig", "LossConfig"),
        "art_core.model": ("TrainableModel",),
        "art_core.host.records": ("TrainResult",),
    },
)
