"""history.jsonl after a real run (tests/helpers_runs.py): every step metric, under ART's names."""

from __future__ import annotations

import math
import statistics
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from art_core.host.step_record import PhaseTimer, rollout_seconds, train_record
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.rollouts.summary import split_metrics
from art_core.storage import ModelStorage
from tests.helpers_runs import LEARNING_RATE, MODEL, PROJECT, StoredRun, build_run


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StoredRun]:
    yield await build_run(tmp_path_factory.mktemp("metrics"))


@pytest.fixture(scope="module")
def history(run: StoredRun) -> list[dict[str, Any]]:
    return ModelStorage.create(run.root, PROJECT, MODEL).read_history()


def _train(history: list[dict[str, Any]], step: int) -> dict[str, Any]:
    (record,) = [h for h in history if h["step"] == step and "trained" in h]
    return record


def _rewards(groups: list[TrajectoryGroup]) -> tuple[float, float]:
    rewards = [t.checked_reward() for g in groups for t in g.trajectories]
    stds = [statistics.pstdev([t.checked_reward() for t in g.trajectories]) for g in groups]
    return statistics.fmean(rewards), statistics.fmean(stds)


@pytest.mark.parametrize("step", [1, 2])
async def test_train_steps_record_rewards_counts_loss_and_times(
    run: StoredRun, history: list[dict[str, Any]], step: int
) -> None:
    record, groups = _train(history, step), run.groups[step]
    mean, std = _rewards(groups)
    assert record["trained"] == 1
    assert record["train/reward"] == pytest.approx(mean)
    assert record["train/reward_std_dev"] == pytest.approx(std) and std > 0
    trajectories = [t for g in groups for t in g.trajectories]
    assert record["train/index"] == pytest.approx(statistics.fmean(t.metrics["index"] for t in trajectories))
    assert record["data/step_num_groups_submitted"] == 2 == record["train/num_groups"]
    assert record["data/step_num_groups_trainable"] == 2
    assert record["data/step_num_trajectories"] == len(trajectories) == record["train/num_trajectories"]
    assert record["data/step_num_gradient_steps"] == 1
    assert record["data/step_trainer_tokens"] == record["loss/tokens"] > 0
    assert math.isfinite(record["loss/train"]) and record["loss/train"] == record["loss/loss"]
    assert 0 < record["loss/entropy"] < math.log(300_000)  # a random model: high, but below log(vocab)
    assert record["loss/grad_norm"] > 0
    assert record["loss/learning_rate"] == LEARNING_RATE
    phases = [record[f"time/{p}_s"] for p in ("rollout", "train", "publish", "checkpoint")]
    assert all(0 <= s < 120 for s in phases) and record["time/rollout_s"] > 0
    # the checkpoint is written in the background: the train call waited only `checkpoint_wait_s` for
    # the previous step's
    assert 0 <= record["time/checkpoint_wait_s"] < 120
    assert record["time/step_s"] >= record["time/train_s"] + record["time/checkpoint_wait_s"]
    # each trained step's re-merge of the served weights runs in its own train call, before the
    # engine resumes: part of its publish
    assert 0 < record["time/remerge_s"] <= record["time/publish_s"]


def test_exceptions_are_rated_and_kl_only_when_computed(history: list[dict[str, Any]]) -> None:
    first, second = _train(history, 1), _train(history, 2)
    assert first["train/exception_rate"] == pytest.approx(1 / 8)  # 7 finished, 1 failed
    assert second["train/exception_rate"] == 0
    assert "loss/kl_policy_ref" not in first
    assert second["loss/kl_policy_ref"] >= 0 and math.isfinite(second["loss/kl_policy_ref"])


def test_judge_calls_and_errors_are_counted_where_ruler_ran(
    run: StoredRun, history: list[dict[str, Any]]
) -> None:
    first, second = _train(history, 1), _train(history, 2)
    assert "train/judge_calls" not in first
    assert second["train/judge_calls"] == run.judge_requests == 3  # 2 groups, one answer retried
    assert second["train/judge_errors"] == 1
    assert second["train/ruler_errors"] == 0


def test_val_is_logged_without_training(run: StoredRun, history: list[dict[str, Any]]) -> None:
    (val,) = [h for h in history if "val/reward" in h]
    mean, std = _rewards(run.val_groups)
    assert val["step"] == 2 and val["val/reward"] == pytest.approx(mean)
    assert val["val/reward_std_dev"] == pytest.approx(std)
    assert not any(k.startswith(("loss/", "train/", "time/")) for k in val)
    storage = ModelStorage.create(run.root, PROJECT, MODEL)
    assert storage.steps() == [0, 1, 2]  # the initial one and two trained: none for val
    stored = storage.read_trajectories("val", 2)
    assert [len(g.trajectories) for g in stored] == [4, 4]
    assert [len(g.trajectories) for g in storage.read_trajectories("train", 1)] == [4, 3]


def test_train_record_of_a_step_that_trained_nothing() -> None:
    group = TrajectoryGroup([Trajectory(reward=1.0), Trajectory(reward=1.0)])
    record = train_record(
        3, [group], {"groups_total": 1, "groups_trainable": 0}, {"trained": 0.0}, {"step": 0.5}
    )
    assert record["trained"] == 0 and record["data/step_num_gradient_steps"] == 0
    assert record["data/step_num_groups_trainable"] == 0 and record["train/reward_std_dev"] == 0
    assert record["time/step_s"] == 0.5 and "loss/grad_norm" not in record


def test_group_metrics_are_summed_for_judge_counts_and_averaged_otherwise() -> None:
    groups = [
        TrajectoryGroup([Trajectory(reward=0.0)], metrics={"judge_calls": 2, "judge_errors": 1, "tries": 1}),
        TrajectoryGroup([Trajectory(reward=1.0)], metrics={"judge_calls": 1, "judge_errors": 0, "tries": 3}),
    ]
    metrics = split_metrics(groups, "val")
    assert metrics["val/judge_calls"] == 3 and metrics["val/judge_errors"] == 1
    assert metrics["val/group_tries"] == 2


def test_phase_timer_adds_up_and_rollout_time_needs_trajectories() -> None:
    timer = PhaseTimer()
    for _ in range(2):
        with timer("publish"):
            pass
    assert set(timer.seconds) == {"publish"} and timer.seconds["publish"] >= 0
    assert rollout_seconds([TrajectoryGroup()], 10.0) == {}
    assert rollout_seconds([TrajectoryGroup([Trajectory(start_time=4.0)])], 10.0) == {"rollout": 6.0}
