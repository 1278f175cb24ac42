"""Rollouts: the records a rollout produces and the runner that gathers them into groups.

`records` (Turn, History, Trajectory, ExceptionInfo), `groups` (TrajectoryGroup,
gather_trajectory_groups, gather_trajectories, GatherError, GatherStats) and `dataset`
(iterate_dataset, DatasetBatch); for ART scripts also `messages` (Messages, Tools, MessageList),
`retry`, `batches` (trajectory_group_batches) and `yielded` (yield_trajectory,
capture_yielded_trajectory). Pydantic only: no torch, so imports are eager.
"""

from art_core.rollouts.batches import trajectory_group_batches
from art_core.rollouts.dataset import DatasetBatch, iterate_dataset
from art_core.rollouts.groups import (
    GatherError,
    GatherStats,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
)
from art_core.rollouts.messages import MessageList, Messages, Tools
from art_core.rollouts.records import CONTEXT_LENGTH_EXCEEDED, ExceptionInfo, History, Trajectory, Turn
from art_core.rollouts.retry import retry
from art_core.rollouts.yielded import capture_yielded_trajectory, yield_trajectory

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "DatasetBatch",
    "ExceptionInfo",
    "GatherError",
    "GatherStats",
    "History",
    "MessageList",
    "Messages",
    "Tools",
    "Trajectory",
    "TrajectoryGroup",
    "Turn",
    "capture_yielded_trajectory",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "retry",
    "trajectory_group_batches",
    "yield_trajectory",
]
