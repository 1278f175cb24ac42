"""art_core: GRPO + LoRA training for LLM agents, served through an OpenAI-compatible endpoint.

The user API (ART-compatible: `import art_core as art` gives ART's public names, see
docs/porting-from-art.md) is exported here. Importing this package is cheap and has no side
effects; heavy modules load on first use. The layers below it are sub-packages (rollouts, capture,
models, storage, training, engine, server, host, backends, app): see docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from art_core._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from art_core import dev as dev
    from art_core import utils as utils
    from art_core.backends.art_compat import LocalTrainResult as LocalTrainResult
    from art_core.backends.art_compat import NotSupportedError as NotSupportedError
    from art_core.backends.art_compat import ServerlessBackend as ServerlessBackend
    from art_core.backends.art_compat import ServerlessTrainResult as ServerlessTrainResult
    from art_core.backends.art_compat import TrainSFTConfig as TrainSFTConfig
    from art_core.backends.local import LocalBackend as LocalBackend
    from art_core.host.records import TrainResult as TrainResult
    from art_core.model import Backend as Backend
    from art_core.model import Model as Model
    from art_core.model import TrainableModel as TrainableModel
    from art_core.rollouts.batches import trajectory_group_batches as trajectory_group_batches
    from art_core.rollouts.dataset import DatasetBatch as DatasetBatch
    from art_core.rollouts.dataset import iterate_dataset as iterate_dataset
    from art_core.rollouts.groups import TrajectoryGroup as TrajectoryGroup
    from art_core.rollouts.groups import gather_trajectories as gather_trajectories
    from art_core.rollouts.groups import gather_trajectory_groups as gather_trajectory_groups
    from art_core.rollouts.messages import Messages as Messages
    from art_core.rollouts.messages import Tools as Tools
    from art_core.rollouts.records import History as History
    from art_core.rollouts.records import MessagesAndChoices as MessagesAndChoices
    from art_core.rollouts.records import Trajectory as Trajectory
    from art_core.rollouts.records import Turn as Turn
    from art_core.rollouts.retry import retry as retry
    from art_core.rollouts.unsupported import auto_trajectory as auto_trajectory
    from art_core.rollouts.unsupported import capture_auto_trajectory as capture_auto_trajectory
    from art_core.rollouts.yielded import capture_yielded_trajectory as capture_yielded_trajectory
    from art_core.rollouts.yielded import yield_trajectory as yield_trajectory
    from art_core.training.config import LossConfig as LossConfig
    from art_core.training.config import TrainConfig as TrainConfig

__all__, _getattr = lazy_exports(
    __name__,
    {
        "art_core.rollouts.records": (
            "Trajectory",
            "History",
            "Turn",
            "MessagesAndChoices",
        ),
        "art_core.rollouts.messages": ("Messages", "Tools"),
        "art_core.rollouts.groups": ("TrajectoryGroup", "gather_trajectory_groups", "gather_trajectories"),
        "art_core.rollouts.batches": ("trajectory_group_batches",),
        "art_core.rollouts.dataset": ("iterate_dataset", "DatasetBatch"),
        "art_core.rollouts.retry": ("retry",),
        "art_core.rollouts.yielded": ("yield_trajectory", "capture_yielded_trajectory"),
        "art_core.rollouts.unsupported": ("auto_trajectory", "capture_auto_trajectory"),
        "art_core.training.config": ("TrainConfig", "LossConfig"),
        "art_core.model": ("Model", "TrainableModel", "Backend"),
        "art_core.host.records": ("TrainResult",),
        "art_core.backends.local": ("LocalBackend",),
        "art_core.backends.art_compat": (
            "LocalTrainResult",
            "NotSupportedError",
            "ServerlessBackend",
            "ServerlessTrainResult",
            "TrainSFTConfig",
        ),
    },
)
_SUBMODULES = ("dev", "utils")
__all__ = sorted([*__all__, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    """Lazy exports, plus ART's submodules `art.dev` and `art.utils` (imported on first use)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _getattr(name)
