"""gather_trajectory_groups with real asyncio rollouts (short sleeps, no model)."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

from art_core.rollouts.groups import (
    GatherError,
    GatherStats,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
)
from art_core.rollouts.records import Trajectory


@dataclass
class Rollouts:
    """Makes rollout coroutines and records what each one did."""

    running: int = 0
    max_running: int = 0
    started: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)

    async def run(
        self, name: str, delay: float = 0.01, reward: float | None = 1.0, fail: bool = False
    ) -> Any:
        self.started.add(name)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(delay)
            if fail:
                raise ValueError(f"rollout {name} failed on purpose")
            self.completed.add(name)
            return Trajectory(messages=[{"role": "user", "content": name}], reward=reward)
        except asyncio.CancelledError:
            self.cancelled.add(name)
            raise
        finally:
            self.running -= 1


def names(group: TrajectoryGroup) -> list[str]:
    return [t.messages[0]["content"] for t in group]


async def test_groups_keep_input_order_and_rollouts_their_given_order() -> None:
    r = Rollouts()
    groups = [
        TrajectoryGroup([r.run("a0", 0.05), r.run("a1", 0.01)]),
        TrajectoryGroup([r.run("b0", 0.02), r.run("b1", 0.001)]),
        TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": "done"}]), r.run("c0", 0.0)]),
    ]
    result = await gather_trajectory_groups(groups, pbar=False)
    assert [names(g) for g in result] == [["a0", "a1"], ["b0", "b1"], ["done", "c0"]]
    assert result[0] is groups[0]
    assert all(g.pending == [] and g.metrics["exceptions"] == 0 for g in result)
    assert result.stats.trajectories == 6 and result.stats.exceptions == 0  # type: ignore[attr-defined]


async def test_exceptions_are_kept_with_tracebacks_within_budget() -> None:
    r = Rollouts()
    groups = [
        TrajectoryGroup([r.run("a0"), r.run("a1", fail=True)]),
        TrajectoryGroup([r.run("b0"), r.run("b1")]),
    ]
    result = await gather_trajectory_groups(groups, pbar=False, max_exceptions=1)
    assert [names(g) for g in result] == [["a0"], ["b0", "b1"]]
    (info,) = result[0].exceptions
    assert info.type == "ValueError" and info.message == "rollout a1 failed on purpose"
    assert "Traceback" in info.traceback and "in run" in info.traceback
    assert result[0].metrics["exceptions"] == 1 and result[1].metrics["exceptions"] == 0
    stats: GatherStats = result.stats  # type: ignore[attr-defined]
    assert stats.exceptions == 1 and stats.trajectories == 3


async def test_over_count_budget_raises_and_cancels_the_rest() -> None:
    r = Rollouts()
    groups = [
        TrajectoryGroup([r.run("f0", 0.01, fail=True), r.run("f1", 0.02, fail=True), r.run("s0", 10)]),
        TrajectoryGroup([r.run("s1", 10), r.run("ok", 0.0)]),
    ]
    with pytest.raises(GatherError) as caught:
        await gather_trajectory_groups(groups, pbar=False, max_exceptions=1)
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert "2 rollout(s) failed" in str(error) and "rollout f0 failed on purpose" in str(error)
    assert isinstance(error.__cause__, ValueError) and str(error.__cause__) == "rollout f0 failed on purpose"
    assert [e.message for e in error.exceptions] == [
        "rollout f0 failed on purpose",
        "rollout f1 failed on purpose",
    ]
    assert r.cancelled == {"s0", "s1"} and r.completed == {"ok"}
    assert r.running == 0


async def test_default_budget_raises_on_first_exception() -> None:
    r = Rollouts()
    with pytest.raises(GatherError, match="1 rollout"):
        await gather_trajectory_groups([TrajectoryGroup([r.run("f", fail=True), r.run("s", 10)])], pbar=False)
    assert r.cancelled == {"s"}


async def test_fraction_budget() -> None:
    r = Rollouts()

    def groups(failures: int) -> list[TrajectoryGroup]:
        return [
            TrajectoryGroup(r.run(f"g{g}r{i}", fail=g * 5 + i < failures) for i in range(5)) for g in range(2)
        ]

    result = await gather_trajectory_groups(groups(1), pbar=False, max_exceptions=0.1)
    assert sum(len(g) for g in result) == 9
    with pytest.raises(GatherError, match=r"10% of 10 trajectories"):
        await gather_trajectory_groups(groups(2), pbar=False, max_exceptions=0.1)


async def test_fraction_waits_for_awaitable_groups_before_judging() -> None:
    """2 early failures are 100% of the trajectories known at first, but 25% of the final 8."""
    r = Rollouts()

    async def late_group() -> TrajectoryGroup:
        await asyncio.sleep(0.05)
        return TrajectoryGroup(r.run(f"late{i}", 0.0) for i in range(6))

    groups = [TrajectoryGroup([r.run("f0", 0.0, fail=True), r.run("f1", 0.0, fail=True)]), late_group()]
    result = await gather_trajectory_groups(groups, pbar=False, max_exceptions=0.5)
    assert [len(g) for g in result] == [0, 6]
    assert len(result[0].exceptions) == 2


async def test_max_concurrency_is_respected_across_groups() -> None:
    r = Rollouts()
    groups = [TrajectoryGroup(r.run(f"{g}.{i}", 0.005) for i in range(4)) for g in range(3)]
    result = await gather_trajectory_groups(groups, pbar=False, max_concurrency=3)
    assert sum(len(g) for g in result) == 12
    assert r.max_running == 3
    r2 = Rollouts()
    await gather_trajectory_groups([TrajectoryGroup(r2.run(str(i), 0.005) for i in range(12))], pbar=False)
    assert r2.max_running == 12


async def test_cancelled_gather_leaves_no_pending_tasks_or_unawaited_coroutines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Rollouts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(GatherError):
            await gather_trajectory_groups(
                [TrajectoryGroup([r.run("f", 0.0, fail=True), *(r.run(f"w{i}", 10) for i in range(5))])],
                pbar=False,
                max_concurrency=2,
            )
        gc.collect()
        await asyncio.sleep(0)
    # w1 may take f's slot in the same loop iteration as f fails; the others never start.
    assert {"f", "w0"} <= r.started <= {"f", "w0", "w1"}
    assert r.cancelled == r.started - {"f"} and r.completed == set()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert "Task was destroyed" not in caplog.text
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []


async def test_after_each_can_replace_split_and_drop(caplog: pytest.LogCaptureFixture) -> None:
    r = Rollouts()

    async def after_each(group: TrajectoryGroup) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        kind = group.metadata["kind"]
        if kind == "score":
            for traj in group:
                traj.reward = 0.5
            return group
        if kind == "replace":
            return TrajectoryGroup(group.trajectories[:1], metadata={"kind": "replaced"})
        if kind == "split":
            return [TrajectoryGroup([t], metadata={"kind": "piece"}) for t in group]
        return None

    groups = [
        TrajectoryGroup([r.run(f"{kind}{i}", reward=None) for i in range(2)], metadata={"kind": kind})
        for kind in ["score", "drop", "split", "replace"]
    ]
    with caplog.at_level(logging.WARNING, logger="art_core.rollouts.groups"):
        result = await gather_trajectory_groups(groups, pbar=False, after_each=after_each)
    assert [g.metadata["kind"] for g in result] == ["score", "piece", "piece", "replaced"]
    assert [names(g) for g in result] == [["score0", "score1"], ["split0"], ["split1"], ["replace0"]]
    assert [t.reward for t in result[0]] == [0.5, 0.5]
    assert "dropped group 1" in caplog.text
    assert result.stats.dropped_groups == 1  # type: ignore[attr-defined]


async def test_after_each_failures_count_against_the_budget() -> None:
    r = Rollouts()

    async def judge(group: TrajectoryGroup) -> TrajectoryGroup:
        if group.metadata["bad"]:
            raise RuntimeError("judge unreachable")
        return group

    def groups() -> list[TrajectoryGroup]:
        return [TrajectoryGroup([r.run(f"{b}")], metadata={"bad": b}) for b in (False, True)]

    with pytest.raises(GatherError, match="judge unreachable"):
        await gather_trajectory_groups(groups(), pbar=False, after_each=judge)
    result = await gather_trajectory_groups(groups(), pbar=False, after_each=judge, max_exceptions=1)
    assert len(result) == 2 and len(result[1]) == 1
    assert result[1].exceptions[0].message == "judge unreachable"
    assert result[1].metrics["after_each_errors"] == 1

    async def wrong(group: TrajectoryGroup) -> Any:
        return "not a group"

    result = await gather_trajectory_groups(groups(), pbar=False, after_each=wrong, max_exceptions=2)
    assert all("after_each must return" in g.exceptions[0].message for g in result)


async def test_awaiting_a_group_runs_its_rollouts() -> None:
    r = Rollouts()
    group = await TrajectoryGroup(r.run(str(i), reward=float(i)) for i in range(3))
    assert isinstance(group, TrajectoryGroup)
    assert [t.reward for t in group] == [0.0, 1.0, 2.0]
    with pytest.raises(GatherError):
        await TrajectoryGroup([r.run("x", fail=True)])


async def test_awaitable_groups_and_their_failures() -> None:
    r = Rollouts()

    async def make(i: int) -> TrajectoryGroup:
        if i == 1:
            raise LookupError("no scenario 1")
        return TrajectoryGroup([r.run(f"{i}a"), r.run(f"{i}b")])

    result = await gather_trajectory_groups((make(i) for i in range(3)), pbar=False, max_exceptions=1)
    assert [names(g) for g in result] == [["0a", "0b"], [], ["2a", "2b"]]
    assert result[1].exceptions[0].type == "LookupError"


async def test_non_trajectory_return_is_counted_as_type_error() -> None:
    async def bad() -> Any:
        return {"reward": 1.0}

    result = await gather_trajectory_groups(
        [TrajectoryGroup([bad(), Rollouts().run("ok")])], pbar=False, max_exceptions=1
    )
    (info,) = result[0].exceptions
    assert info.type == "TypeError"
    assert "returned dict, not a Trajectory" in info.message
    assert names(result[0]) == ["ok"]


async def test_gather_trajectories_returns_successes_in_order() -> None:
    r = Rollouts()
    trajs = await gather_trajectories(
        [r.run("a", 0.02), r.run("b", fail=True), r.run("c", 0.0)], pbar=False, max_exceptions=1
    )
    assert [t.messages[0]["content"] for t in trajs] == ["a", "c"]


async def test_progress_bar_runs_and_writes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    r = Rollouts()
    groups = [TrajectoryGroup([r.run("a", reward=1.0), r.run("b", reward=0.0), r.run("c", fail=True)])]
    result = await gather_trajectory_groups(groups, pbar=True, pbar_desc="rollouts", max_exceptions=1)
    assert len(result[0]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "rollouts reward=0.500 exceptions=1" in captured.err
    assert "3/3" in captured.err


@pytest.mark.parametrize("bad", [-1, float("nan"), True])
async def test_invalid_max_exceptions_is_rejected(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="max_exceptions"):
        await gather_trajectory_groups([], pbar=False, max_exceptions=bad)


async def test_invalid_max_concurrency_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        await gather_trajectory_groups([], pbar=False, max_concurrency=0)


async def test_synchronous_after_each_results_and_failures_are_handled() -> None:
    r = Rollouts()

    def label(group: TrajectoryGroup) -> TrajectoryGroup:
        if group.metadata["bad"]:
            raise RuntimeError("sync judge failed")
        group.metadata["labelled"] = True
        return group

    groups = [TrajectoryGroup([r.run(f"{b}")], metadata={"bad": b}) for b in (False, True)]
    result = await gather_trajectory_groups(groups, pbar=False, after_each=label, max_exceptions=1)
    assert result[0].metadata["labelled"] is True
    assert result[1].exceptions[0].message == "sync judge failed"
