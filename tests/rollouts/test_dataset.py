"""iterate_dataset: batching, deterministic per-epoch shuffles, exact resume."""

from __future__ import annotations

import dataclasses

import pytest

from art_core.rollouts.dataset import DatasetBatch, epoch_order, iterate_dataset, steps_per_epoch


def test_batches_cover_each_epoch_once_with_a_smaller_last_batch() -> None:
    items = list(range(10))
    batches = list(iterate_dataset(items, groups_per_step=4, num_epochs=2))
    assert [len(b.items) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert [b.step for b in batches] == list(range(6))
    assert [(b.epoch, b.epoch_step) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for epoch in (0, 1):
        seen = [x for b in batches if b.epoch == epoch for x in b.items]
        assert sorted(seen) == items
    assert steps_per_epoch(10, 4) == 3


def test_shuffle_is_deterministic_differs_per_epoch_and_per_seed() -> None:
    first = [b.items for b in iterate_dataset(range(20), groups_per_step=20, num_epochs=2)]
    again = [b.items for b in iterate_dataset(range(20), groups_per_step=20, num_epochs=2)]
    other_seed = [b.items for b in iterate_dataset(range(20), groups_per_step=20, num_epochs=2, seed=1)]
    assert first == again
    assert first[0] != first[1]
    assert first != other_seed
    assert first[0] != list(range(20))
    assert first[0] == epoch_order(20, epoch=0)


def test_no_shuffle_keeps_dataset_order() -> None:
    batches = list(iterate_dataset("abcde", groups_per_step=2, shuffle=False))
    assert [b.items for b in batches] == [["a", "b"], ["c", "d"], ["e"]]


@pytest.mark.parametrize("initial_step", [0, 1, 3, 5, 7])
def test_resume_continues_at_exactly_the_same_position(initial_step: int) -> None:
    items = [f"s{i}" for i in range(7)]
    full = list(iterate_dataset(items, groups_per_step=3, num_epochs=3, seed=42))
    resumed = list(
        iterate_dataset(items, groups_per_step=3, num_epochs=3, seed=42, initial_step=initial_step)
    )
    assert resumed == full[initial_step:]


def test_resume_past_the_end_yields_nothing() -> None:
    assert list(iterate_dataset([1, 2], num_epochs=2, initial_step=4)) == []


def test_batch_is_frozen() -> None:
    batch = next(iterate_dataset([1]))
    assert batch == DatasetBatch(items=[1], step=0, epoch=0, epoch_step=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.step = 3  # type: ignore[misc]


def test_generators_are_accepted() -> None:
    assert sum(len(b.items) for b in iterate_dataset((i for i in range(5)), groups_per_step=2)) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"items": []}, "empty dataset"),
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"num_epochs": 0}, "num_epochs"),
        ({"initial_step": -1}, "initial_step"),
    ],
)
def test_invalid_arguments(kwargs: dict, message: str) -> None:
    args = {"items": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message):
        next(iterate_dataset(**args))
