"""The decode loop's thread tuner: it keeps the faster thread count and re-checks when steps slow down."""

from __future__ import annotations

import pytest
import torch

from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import DecodeBatch, RowState
from art_core.engine.torch.threads import ThreadTuner
from art_core.models.loading import LoadedModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def feed(tuner: ThreadTuner, step_s: dict[int, float], steps: int, rows: int = 32) -> list[int]:
    """Run `steps` steps whose time depends on the thread count; the counts used, step by step."""
    used = []
    for _ in range(steps):
        used.append(tuner.current)
        tuner.record(rows, step_s[tuner.current])
    return used


def test_keeps_the_faster_count_either_way() -> None:
    quiet = ThreadTuner((1, 2), trial_steps=3, hold_steps=50)
    feed(quiet, {1: 0.10, 2: 0.06}, 20)
    assert quiet.current == 2 and not quiet.exploring
    shared = ThreadTuner((1, 2), trial_steps=3, hold_steps=50)
    feed(shared, {1: 0.10, 2: 0.40}, 20)  # 2 threads stall on a loaded machine
    assert shared.current == 1


def test_explores_most_threads_first_and_each_candidate_for_its_trial() -> None:
    tuner = ThreadTuner((1, 2), trial_steps=3, hold_steps=50)
    used = feed(tuner, {1: 0.1, 2: 0.2}, 7)
    # step 0 only sets the batch size (the trials restart), then 3 steps of 2 threads, 3 of 1
    assert used == [2, 2, 2, 2, 1, 1, 1]
    assert tuner.current == 1


def test_a_slowdown_at_the_chosen_count_triggers_a_new_choice() -> None:
    tuner = ThreadTuner((1, 2), trial_steps=3, hold_steps=10_000)
    feed(tuner, {1: 0.10, 2: 0.06}, 10)
    assert tuner.current == 2
    used = feed(tuner, {1: 0.10, 2: 0.30}, 30)  # other work arrives: 2 threads now stall
    assert 1 in used and tuner.current == 1


def test_re_explores_after_hold_steps_and_follows_the_load_back() -> None:
    tuner = ThreadTuner((1, 2), trial_steps=3, hold_steps=20)
    feed(tuner, {1: 0.10, 2: 0.30}, 10)
    assert tuner.current == 1
    feed(tuner, {1: 0.10, 2: 0.05}, 40)  # the load left: the next exploration finds 2 faster
    assert tuner.current == 2


def test_batch_size_change_restarts_the_trials_and_one_candidate_never_moves() -> None:
    tuner = ThreadTuner((1, 2), trial_steps=3, hold_steps=50)
    feed(tuner, {1: 0.1, 2: 0.2}, 3, rows=32)
    assert tuner.exploring
    feed(tuner, {1: 0.1, 2: 0.2}, 7, rows=8)
    assert tuner.current == 1 and not tuner.exploring
    single = ThreadTuner((2,))
    assert feed(single, {2: 0.1}, 5) == [2] * 5


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="thread counts"):
        ThreadTuner((0, 2))
    with pytest.raises(ValueError, match="trial_steps"):
        ThreadTuner((1, 2), trial_steps=1)


def test_decode_loop_under_the_tuner_switches_threads_and_decodes_the_same(tiny_model: LoadedModel) -> None:
    """The decode loop applies the tuner's choices (1 and 2 threads here) without changing what it samples."""

    def decode(threads: ThreadTuner | None) -> list[int]:
        row = RowState(
            None, 0, [5, 9, 14, 20, 33], GREEDY, None, 12, torch.Generator().manual_seed(0), frozenset()
        )
        with torch.inference_mode():
            DecodeBatch(tiny_model.model, tiny_model.tokenizer, [row], use_adapter_names=False).run(
                0.25, threads=threads
            )
        return row.token_ids

    before = torch.get_num_threads()
    seen: list[int] = []
    tuner = ThreadTuner((1, 2), trial_steps=2, hold_steps=3)
    record = tuner.record

    def spying(rows: int, seconds: float) -> int:
        seen.append(torch.get_num_threads())
        return record(rows, seconds)

    tuner.record = spying  # type: ignore[method-assign]
    try:
        assert decode(tuner) == decode(None)
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 11 and {1, 2} <= set(seen)  # every decode step was timed, both counts ran
