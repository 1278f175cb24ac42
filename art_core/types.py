"""The rollout records at their ART-compatible path: a facade over `art_core.rollouts`.

`records` holds Turn, History, Trajectory, TrajectoryGroup and ExceptionInfo; `groups` the gather.
"""

from art_core.rollouts.groups import GatherError, GatherStats, gather_trajectories, gather_trajectory_groups
from art_core.rollouts.records import (
    ExceptionInfo,
    History,
    Message,
    MessagesAndChoices,
    Tool,
    Trajectory,
    TrajectoryGroup,
    Turn,
    message_or_choice,
    turn_from_choice,
)

__all__ = [
    "ExceptionInfo",
    "GatherError",
    "GatherStats",
    "History",
    "Message",
    "MessagesAndChoices",
    "Tool",
    "Trajectory",
    "TrajectoryGroup",
    "Turn",
    "gather_trajectories",
    "gather_trajectory_groups",
    "message_or_choice",
    "turn_from_choice",
]
