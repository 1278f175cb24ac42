"""`run_demo`'s seed: the same seed draws the same replies, another seed other ones (tiny model)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from art_core.app.demo import DemoConfig, rollout_seed, run_demo


def _first_step_replies(tmp_path: Path, seed: int, run: str) -> list[list[list[int]]]:
    """The token ids each rollout of the run's first step sampled, group by group."""
    config = DemoConfig(
        base_model="tiny-random",
        steps=1,
        scenarios_per_step=2,
        group_size=3,
        max_tokens=6,
        path=tmp_path / run,
        name="seeded",
        seed=seed,
    )
    summary = asyncio.run(run_demo(config))
    assert summary.steps == 1
    (written,) = sorted((tmp_path / run).glob("demo/models/seeded/trajectories/train/*.jsonl"))
    groups = [json.loads(line) for line in written.read_text().splitlines()]
    return [
        [trajectory["turns"][-1]["completion_ids"] for trajectory in group["trajectories"]]
        for group in groups
    ]


def test_the_same_seed_samples_the_same_replies_and_another_seed_others(tmp_path: Path) -> None:
    first = _first_step_replies(tmp_path, seed=3, run="a")
    assert len(first) == 2 and all(len(group) == 3 for group in first)
    assert len({tuple(reply) for group in first for reply in group}) == 6  # each rollout its own draw
    assert _first_step_replies(tmp_path, seed=3, run="b") == first
    assert _first_step_replies(tmp_path, seed=4, run="c") != first


def test_rollout_seeds_are_distinct_within_a_run_and_depend_on_the_run_seed() -> None:
    seeds = {
        rollout_seed(0, step, group, index) for step in range(30) for group in range(4) for index in range(8)
    }
    assert len(seeds) == 30 * 4 * 8 and all(0 <= seed < 2**63 for seed in seeds)
    assert rollout_seed(1, 0, 0, 0) not in seeds
