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
    mean, std = mean_std(values)
    centred = [r - mean for r in values]
    if all(r == values[0] for r in values):
        return GroupAdvantages(advantages=[0.0] * len(values), zero_variance=True)
    if scale:
        centred = [c / (std + eps) for c in centred]
    return GroupAdvantages(advantages=centred, zero_variance=False)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of finite `values` (at least one).

    Naively `fsum(v) / n` and `sqrt(fsum((v - mean)^2) / n)`; rescaled where those overflow
    (values near the float limit, e.g. rewards of 1e308), so the result stays finite and right.
    """
    n = len(values)
    try:
        mean = math.fsum(values) / n
    except OverflowError:  # fsum's intermediate sum passed the float limit
        mean = math.fsum(v / n for v in values)
    centred = [v - mean for v in values]
    variance = math.fsum(c * c for c in centred) / n
    if math.isfinite(variance):
        return mean, math.sqrt(variance)
    scale = max(abs(c) for c in centred)
    return mean, scale * math.sqrt(math.fsum((c / scale) ** 2 for c in centred) / n)
