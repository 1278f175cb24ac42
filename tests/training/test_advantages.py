"""Group-relative advantages."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from art_core.training.advantages import group_advantages

rewards_lists = st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=16)


@given(rewards=rewards_lists, scale=st.booleans())
@settings(max_examples=100, deadline=None)
def test_advantages_are_mean_centred(rewards: list[float], scale: bool) -> None:
    result = group_advantages(rewards, scale=scale)
    assert len(result.advantages) == len(rewards)
    assert abs(math.fsum(result.advantages)) <= 1e-9 * max(1.0, max(abs(r) for r in rewards)) * len(rewards)


@given(rewards=rewards_lists)
@settings(max_examples=100, deadline=None)
def test_order_is_kept_monotone(rewards: list[float]) -> None:
    advantages = group_advantages(rewards).advantages
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if rewards[i] < rewards[j]:
                assert advantages[i] <= advantages[j]


def test_unscaled_is_reward_minus_mean() -> None:
    result = group_advantages([1.0, 2.0, 6.0], scale=False)
    assert result.advantages == pytest.approx([-2.0, -1.0, 3.0])
    assert result.zero_variance is False


def test_scaled_divides_by_population_std() -> None:
    rewards = [0.0, 1.0, 1.0, 3.0]
    std = statistics.pstdev(rewards)
    mean = statistics.fmean(rewards)
    result = group_advantages(rewards, eps=0.0)
    assert result.advantages == pytest.approx([(r - mean) / std for r in rewards])
    assert statistics.pstdev(result.advantages) == pytest.approx(1.0)
    assert group_advantages([0.0, 1.0], eps=1.0).advantages == pytest.approx([-1 / 3, 1 / 3])


@pytest.mark.parametrize("scale", [True, False])
def test_zero_variance_is_flagged(scale: bool) -> None:
    result = group_advantages([0.7, 0.7, 0.7], scale=scale)
    assert result.zero_variance is True
    assert result.advantages == [0.0, 0.0, 0.0]
    single = group_advantages([5.0], scale=scale)
    assert single.zero_variance is True and single.advantages == [0.0]


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="index 2"):
        group_advantages([0.0, 1.0, math.nan])
    with pytest.raises(ValueError, match="index 0"):
        group_advantages([math.inf, 1.0])
    with pytest.raises(ValueError, match="index 1"):
        group_advantages([0.0, -math.inf])
