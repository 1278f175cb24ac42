"""Rollouts: the records a rollout produces and the runner that gathers them into groups.

`records` (Turn, History, Trajectory, ExceptionInfo), `groups` (TrajectoryGroup,
gather_trajectory_groups, gather_trajectories, GatherError, GatherStats) and `dataset`
(iterate_dataset, DatasetBatch). Pydantic only: no torch, so imports are eager.
"""

from art_core.rollouts.dataset import DatasetBatch, iterate_dataset
from art_core.rollouts.groups import (
    GatherError,
    GatherStats,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
)
from art_core.rollouts.records import ExceptionInfo, History, Trajectory, Turn

__all__ = [
    "DatasetBatch",
    "ExceptionInfo",
    "GatherError",
    "GatherStats",
    "History",
    "Trajectory",
    "TrajectoryGroup",
    "Turn",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
]
