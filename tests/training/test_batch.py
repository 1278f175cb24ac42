"""prepare_batch: advantages, skips that are counted and explained, errors the user must fix; packing."""

from __future__ import annotations

import math

import pytest
import torch

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import History, Trajectory, Turn
from art_core.training.batch import (
    BatchTotals,
    PreparedBatch,
    TrainingExample,
    collate,
    group_micro_batches,
    micro_batches,
    packed_tokens,
    prepare_batch,
)
from art_core.training.logprobs import IGNORE_INDEX
from art_core.training.sequences import NoTrainableTokensError, TokenSequence


def trajectory(
    reward: float | None, completion: tuple[int, ...] = (5, 6), prompt: tuple[int, ...] = (1, 2)
) -> Trajectory:
    turn = Turn(prompt_ids=list(prompt), completion_ids=list(completion), logprobs=[-1.0] * len(completion))
    return Trajectory(turns=[turn], reward=reward)


def no_tokens(reward: float) -> Trajectory:
    return Trajectory(messages=[{"role": "assistant", "content": "prefilled"}], reward=reward)


def group(*trajectories: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories)


def test_advantages_and_examples() -> None:
    batch = prepare_batch([group(trajectory(1.0), trajectory(0.0))], scale_rewards=True, max_context=100)
    assert [round(e.advantage, 4) for e in batch.examples] == [1.0, -1.0]
    assert [(e.group_index, e.trajectory_index) for e in batch.examples] == [(0, 0), (0, 1)]
    assert batch.metrics["reward"] == 0.5 and batch.metrics["groups_trainable"] == 1
    assert batch.metrics["tokens_trained"] == 4 and batch.metrics["examples"] == 2
    assert batch.warnings == []
    assert batch.totals == BatchTotals(num_sequences=2.0, num_tokens=4.0, max_completion_tokens=2.0)


def test_unscaled_advantages() -> None:
    batch = prepare_batch([group(trajectory(3.0), trajectory(1.0))], scale_rewards=False, max_context=100)
    assert [e.advantage for e in batch.examples] == [1.0, -1.0]


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_missing_or_non_finite_reward_raises_naming_the_trajectory(bad: float | None) -> None:
    groups = [group(trajectory(1.0), trajectory(0.0)), group(trajectory(1.0), trajectory(bad))]
    with pytest.raises(ValueError, match="group 1, trajectory 1"):
        prepare_batch(groups, scale_rewards=True, max_context=100)


@pytest.mark.parametrize("marker", ["ruler_errors", "after_each_errors"])
def test_a_group_whose_scoring_failed_is_a_counted_skip_not_zero_rewards(marker: str) -> None:
    failed = TrajectoryGroup([trajectory(None), trajectory(None)], metrics={marker: 1})
    batch = prepare_batch(
        [failed, group(trajectory(1.0), trajectory(0.0))], scale_rewards=True, max_context=100
    )
    assert batch.metrics["groups_unscored"] == 1 and batch.metrics["groups_trainable"] == 1
    assert {e.group_index for e in batch.examples} == {1} and batch.metrics["reward"] == 0.5
    assert any("group 0" in w and "its scoring failed" in w for w in batch.warnings)


def test_unset_rewards_without_a_counted_scoring_failure_still_raise() -> None:
    partly = TrajectoryGroup([trajectory(1.0), trajectory(None)], metrics={"ruler_errors": 1})
    for bad in (group(trajectory(None), trajectory(None)), partly):
        with pytest.raises(ValueError, match="trajectory has no reward"):
            prepare_batch([bad], scale_rewards=True, max_context=100)


def test_empty_group_is_a_counted_skip() -> None:
    batch = prepare_batch(
        [group(), group(trajectory(1.0), trajectory(0.0))], scale_rewards=True, max_context=100
    )
    assert batch.metrics["groups_empty"] == 1 and len(batch.examples) == 2
    assert any("group 0" in w and "no trajectories" in w for w in batch.warnings)


def test_zero_variance_group_is_a_counted_skip() -> None:
    groups = [group(trajectory(1.0), trajectory(1.0)), group(trajectory(1.0), trajectory(0.0))]
    batch = prepare_batch(groups, scale_rewards=True, max_context=100)
    assert batch.metrics["groups_zero_variance"] == 1 and batch.metrics["groups_trainable"] == 1
    assert {e.group_index for e in batch.examples} == {1}
    assert any("group 0" in w and "zero variance" in w for w in batch.warnings)


def test_only_zero_variance_groups_give_an_empty_batch_with_reasons() -> None:
    batch = prepare_batch([group(trajectory(0.0), trajectory(0.0))], scale_rewards=True, max_context=100)
    assert batch.examples == [] and batch.metrics["groups_zero_variance"] == 1 and batch.warnings
    with pytest.raises(ValueError, match="at least one sequence"):
        _ = batch.normalisers("trained")


def test_the_normalisers_count_every_scored_sequence_not_only_the_trained_ones() -> None:
    """GRPO's batch mean: a zero-variance group's sequences and a zero-advantage example add no
    gradient but count in num_sequences, num_tokens and the longest completion; a sequence over
    the context, an unscored group and a trajectory without tokens do not."""
    groups = [
        group(trajectory(1.0), trajectory(0.0)),  # trained: 2 + 2 tokens
        group(trajectory(0.0, completion=(5, 6, 7)), trajectory(0.0, completion=(5, 6, 7, 8, 9))),
        group(trajectory(2.0), trajectory(0.0), trajectory(1.0, completion=(5,))),  # A=0 for the last
        group(trajectory(1.0, completion=tuple(range(3, 40))), trajectory(1.0)),  # one too long
        TrajectoryGroup([trajectory(None), trajectory(None)], metrics={"ruler_errors": 1}),
        group(trajectory(1.0), no_tokens(0.0)),
    ]
    batch = prepare_batch(groups, scale_rewards=False, max_context=20)
    assert batch.metrics["examples"] == 5 and batch.metrics["examples_zero_advantage"] == 1
    scored = [2, 2, 3, 5, 2, 2, 1, 2, 2]
    assert sorted(batch.scored_tokens or []) == sorted(scored)
    assert batch.metrics["sequences_scored"] == len(scored)
    assert batch.totals == BatchTotals(float(len(scored)), float(sum(scored)), 5.0)
    assert batch.normalisers("scored") == batch.totals
    assert batch.normalisers("trained") == BatchTotals(5.0, 10.0, 2.0) == BatchTotals.of(batch.examples)
    with pytest.raises(ValueError, match="'scored' or 'trained'"):
        batch.normalisers("all")


def test_a_hand_built_batch_is_normalised_by_its_examples_and_checked() -> None:
    examples = prepare_batch(
        [group(trajectory(1.0), trajectory(0.0))], scale_rewards=True, max_context=100
    ).examples
    assert PreparedBatch(examples, {}).totals == BatchTotals.of(examples)
    with pytest.raises(ValueError, match="2 examples but 1 scored sequences"):
        _ = PreparedBatch(examples, {}, scored_tokens=[2]).totals


def test_trajectory_without_tokens_is_skipped_when_others_have_tokens() -> None:
    batch = prepare_batch(
        [group(trajectory(1.0), no_tokens(0.0), trajectory(0.5))], scale_rewards=False, max_context=100
    )
    assert batch.metrics["trajectories_skipped_no_tokens"] == 1
    assert any("group 0, trajectory 1" in w and "token records" in w for w in batch.warnings)
    # The skipped trajectory still counts in the group's baseline (mean 0.5).
    assert [(e.trajectory_index, e.advantage) for e in batch.examples] == [(0, 0.5)]
    assert batch.metrics["examples_zero_advantage"] == 1


def test_no_tokens_anywhere_raises() -> None:
    groups = [group(no_tokens(1.0), no_tokens(0.0)), group(no_tokens(1.0), no_tokens(1.0))]
    with pytest.raises(NoTrainableTokensError, match="none of the 4 trajectories"):
        prepare_batch(groups, scale_rewards=True, max_context=100)


def test_too_long_sequence_is_a_counted_skip_not_truncated() -> None:
    long = trajectory(1.0, completion=tuple(range(10, 30)))
    batch = prepare_batch([group(long, trajectory(0.0))], scale_rewards=True, max_context=10)
    assert batch.metrics["sequences_too_long"] == 1
    assert [len(e.sequence) for e in batch.examples] == [4]
    assert any("22 tokens exceed" in w and "context of 10" in w for w in batch.warnings)


def test_zero_advantage_examples_are_dropped_but_counted() -> None:
    groups = [group(trajectory(1.0), trajectory(0.5), trajectory(0.0))]
    batch = prepare_batch(groups, scale_rewards=True, max_context=100)
    assert [e.trajectory_index for e in batch.examples] == [0, 2]
    assert batch.metrics["examples_zero_advantage"] == 1


def test_additional_histories_share_the_advantage() -> None:
    extra = History(turns=[Turn(prompt_ids=[9], completion_ids=[8, 7], logprobs=[-1.0, -1.0])])
    main = trajectory(1.0)
    main.additional_histories.append(extra)
    batch = prepare_batch([group(main, trajectory(0.0))], scale_rewards=True, max_context=100)
    assert [(e.trajectory_index, e.sequence.token_ids) for e in batch.examples] == [
        (0, (1, 2, 5, 6)),
        (0, (9, 8, 7)),
        (1, (1, 2, 5, 6)),
    ]
    assert batch.examples[0].advantage == batch.examples[1].advantage


def test_no_groups_gives_an_empty_batch() -> None:
    batch = prepare_batch([], scale_rewards=True, max_context=100)
    assert batch.examples == [] and batch.warnings


def example(length: int, advantage: float = 1.0) -> TrainingExample:
    mask = tuple([0] + [1] * (length - 1))
    logprobs = tuple([math.nan] + [-0.1 * i for i in range(1, length)])
    return TrainingExample(TokenSequence(tuple(range(1, length + 1)), mask, logprobs), advantage, 0, length)


def test_micro_batches_pack_by_padded_length() -> None:
    examples = [example(n) for n in (3, 8, 5, 8, 2)]
    batches = micro_batches(examples, micro_batch_tokens=16)
    assert [[len(e.sequence) for e in b] for b in batches] == [[8, 8], [5, 3, 2]]
    # a sequence over the budget gets its own micro-batch rather than being dropped
    assert [[len(e.sequence) for e in b] for b in micro_batches(examples, 6)] == [[8], [8], [5], [3, 2]]
    assert sum(len(b) for b in micro_batches(examples, 1)) == len(examples)


def test_group_micro_batches_keep_groups_whole_within_the_budgets() -> None:
    groups = [[example(n) for n in lengths] for lengths in ((4, 3), (5, 5), (2,), (9, 9, 9))]

    def lengths(batches: list[list[TrainingExample]]) -> list[list[int]]:
        return [[len(e.sequence) for e in b] for b in batches]

    assert lengths(group_micro_batches(groups, 100, 100)) == [[4, 3, 5, 5, 2, 9, 9, 9]]
    # 4 x 5 = 20 padded tokens fit, 5 x 5 = 25 do not; a group over the budget alone is split
    assert lengths(group_micro_batches(groups, 20, 100)) == [[4, 3, 5, 5], [2], [9, 9], [9]]
    # every row here starts with token 1: one shared token, then 4 rows x 3 own tokens = 13
    assert packed_tokens(groups[:2]) == 1 + 4 * 3
    assert lengths(group_micro_batches(groups, 100, 13)) == [[4, 3, 5, 5], [2], [9, 9, 9]]
    assert lengths(group_micro_batches(groups, 100, 12)) == [[4, 3], [5, 5, 2], [9, 9, 9]]
    for budget in (1, 7, 30):
        assert sum(len(b) for b in group_micro_batches(groups, budget, budget)) == 8


def test_packed_tokens_count_each_group_prompt_once() -> None:
    def row(prompt: tuple[int, ...], completion: int) -> TrainingExample:
        ids = prompt + tuple(range(100, 100 + completion))
        return TrainingExample(TokenSequence(ids, (0,) * len(ids), (math.nan,) * len(ids)), 1.0, 0, 0)

    system = (1, 2, 3, 4)
    one = [row(system + (5, 6, 7), 2), row(system + (5, 6, 7), 4)]  # inputs of 8 and 10 tokens
    two = [row(system + (8, 9), 4), row(system + (8, 9), 4), row(system + (8, 9), 2)]  # 9, 9, 7
    # 4 shared by all; group one's rows share 3 more (the shorter row keeps token 100 as its own),
    # group two's 2 (its shortest row keeps one); own tokens at most 10 - 7 = 3; 5 rows.
    assert packed_tokens([one, two]) == 4 + 2 * 3 + 5 * 3
    assert packed_tokens([two]) == 6 + 1 * 0 + 3 * 3  # one group: its whole common run is the prefix


def test_collate_aligns_targets_mask_and_logprobs() -> None:
    out = collate([example(4, 1.0), example(2, -1.0)], pad_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 3], [1, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["targets"].tolist() == [[2, 3, 4], [2, IGNORE_INDEX, IGNORE_INDEX]]
    assert out["mask"].tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert torch.allclose(out["engine_logprobs"][0], torch.tensor([-0.1, -0.2, -0.3]))
    assert torch.isnan(out["engine_logprobs"][1, 1:]).all()
    assert out["advantages"].tolist() == [1.0, -1.0]
    assert out["groups"].tolist() == [0, 0]
