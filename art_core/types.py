"""The rollout records at their ART-compatible path: a facade over `art_core.rollouts`.

`records` holds Turn, History, Trajectory and ExceptionInfo; `groups` TrajectoryGroup and the gather.
"""

from art_core.rollouts.groups import (
    GatherError,
    GatherStats,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
)
from art_core.rollouts.messages import MessageList, Messages, Tools
from art_core.rollouts.records import (
    ExceptionInfo,
    History,
    Message,
    MessagesAndChoices,
    Tool,
    Trajectory,
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
    "MessageList",
    "Messages",
    "MessagesAndChoices",
    "Tool",
    "Tools",
    "Trajectory",
    "TrajectoryGroup",
    "Turn",
    "gather_trajectories",
    "gather_trajectory_groups",
    "message_or_choice",
    "turn_from_choice",
]
