"""Stepping through a dataset of scenarios, with a deterministic shuffle so that runs can resume.

`iterate_dataset` mirrors ART's `art.utils.iterate_dataset`: each epoch is a fresh permutation
(seeded by `seed` and the epoch number only), cut into batches of `groups_per_step` items; the
last batch of an epoch may be smaller. Every batch has a global step number, so a resumed run
that passes `initial_step=await model.get_step()` continues at exactly the same data position.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")


@dataclass(frozen=True)
class DatasetBatch(Generic[Item]):
    """The items of one training step and where they sit in the dataset."""

    items: list[Item]
    """The scenarios of this step (usually one trajectory group each)."""
    step: int
    """Global step number, counted from 0 across epochs."""
    epoch: int
    """Epoch number, from 0."""
    epoch_step: int
    """Step number within the epoch, from 0."""


def steps_per_epoch(num_items: int, groups_per_step: int) -> int:
    """Batches in one epoch: the last one may be smaller than `groups_per_step`."""
    return math.ceil(num_items / groups_per_step)


def epoch_order(num_items: int, epoch: int, seed: int = 0, shuffle: bool = True) -> list[int]:
    """The item indices of one epoch, in the order they are visited (same for same arguments)."""
    order = list(range(num_items))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`, stable across processes and platforms.
        random.Random(f"iterate_dataset:{seed}:{epoch}").shuffle(order)
    return order


def iterate_dataset(
    items: Sequence[Item] | Iterable[Item],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    seed: int = 0,
    shuffle: bool = True,
) -> Iterator[DatasetBatch[Item]]:
    """Yield the batches of `num_epochs` passes over `items`, starting at global step `initial_step`.

    Raises:
        ValueError: an empty dataset, or a non-positive `groups_per_step`/`num_epochs`, or a
            negative `initial_step`.
    """
    data = items if isinstance(items, Sequence) else list(items)
    if len(data) == 0:
        raise ValueError("iterate_dataset got an empty dataset; pass at least one item")
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    if initial_step < 0:
        raise ValueError(f"initial_step must be >= 0, got {initial_step}")
    per_epoch = steps_per_epoch(len(data), groups_per_step)
    for epoch in range(initial_step // per_epoch, num_epochs):
        order = epoch_order(len(data), epoch, seed, shuffle)
        for epoch_step in range(per_epoch):
            step = epoch * per_epoch + epoch_step
            if step < initial_step:
                continue
            start = epoch_step * groups_per_step
            batch = [data[i] for i in order[start : start + groups_per_step]]
            yield DatasetBatch(items=batch, step=step, epoch=epoch, epoch_step=epoch_step)
