"""Group-relative advantages (GRPO): each trajectory's reward compared with its group's.

Included: mean-centring within one group, optional division by the group's population std (GRPO; turn it
off for Dr. GRPO), and a flag for zero-variance groups (all rewards equal: nothing to learn, all zeros).
Left out: baselines across groups, batch-level whitening, leave-one-out (RLOO) baselines, reward clipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one group of trajectories that answered the same scenario."""

    advantages: list[float]
    """One advantage per trajectory, in the order of the rewards."""
    zero_variance: bool
    """True when all rewards are equal; then every advantage is 0 and the group teaches nothing."""


def group_advantages(rewards: Sequence[float], scale: bool = True, eps: float = 1e-6) -> GroupAdvantages:
    """A_i = r_i - mean(r), divided by (population std + eps) when `scale`.

    Raises ValueError for an empty group or a non-finite reward (naming its index).
    """
    if len(rewards) == 0:
        raise ValueError("group_advantages needs at least one reward; got an empty group")
    for index, reward in enumerate(rewards):
        if not math.isfinite(reward):
            raise ValueError(f"reward at index {index} is {reward}; rewards must be finite numbers")
    values = [float(r) for r in rewards]
    mean = math.fsum(values) / len(values)
    centred = [r - mean for r in values]
    if all(r == values[0] for r in values):
        return GroupAdvantages(advantages=[0.0] * len(values), zero_variance=True)
    if scale:
        std = math.sqrt(math.fsum(c * c for c in centred) / len(values))
        centred = [c / (std + eps) for c in centred]
    return GroupAdvantages(advantages=centred, zero_variance=False)
