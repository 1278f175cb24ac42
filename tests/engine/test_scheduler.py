"""The torch engine's batching rules (`Scheduler.plan`, `Scheduler.lanes`), checked as data, without a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from art_core.engine.torch.scheduler import Gate, Lane, Scheduler, Serving, shared_prompt_length


@dataclass(eq=False)
class Row:
    adapter: str | None = "live"
    cancelled: bool = False
    prompt_ids: list[int] = field(default_factory=lambda: list(range(20)))


SERVING = Serving("live")
SCHEDULER = Scheduler(max_batch_size=4, batch_wait_s=0.005, batch_wait_max_s=0.05)


def test_a_batch_waits_for_the_burst_then_starts_with_at_most_max_rows() -> None:
    rows = [Row() for _ in range(3)]
    waiting = SCHEDULER.plan(rows, None, now=10.002, arrived=10.0, since=10.0)
    assert waiting.wait_s == pytest.approx(0.003) and not waiting.start and waiting.queue is None
    capped = SCHEDULER.plan(rows, None, now=10.049, arrived=10.048, since=10.0)  # arrivals keep coming
    assert capped.wait_s == pytest.approx(0.001)
    assert SCHEDULER.plan(rows, None, now=10.006, arrived=10.0, since=10.0).start == tuple(rows)
    many = [Row(cancelled=i == 1) for i in range(7)]
    full = SCHEDULER.plan(many, None, now=10.0, arrived=10.0, since=10.0)  # a full batch does not wait
    assert full.wait_s == 0 and full.start == (many[0], *many[2:5]) and full.queue == tuple(many[5:])


@pytest.mark.parametrize("gate", [Gate(paused=True), Gate(closed=True)])
def test_nothing_starts_while_paused_or_closed(gate: Gate) -> None:
    assert SCHEDULER.plan([Row()] * 8, None, gate=gate, now=99.0) == SCHEDULER.plan([], None, gate=gate)
    assert SCHEDULER.plan([Row()] * 8, None, gate=gate, now=99.0).start == ()


def test_adapter_operations_and_re_merges_wait_for_the_batch_not_for_the_start() -> None:
    gate = Gate(ops_waiting=True, resync_due=True)
    assert SCHEDULER.plan([Row()] * 4, None, gate=gate).start  # they run before the batch
    for blocked in (gate, Gate(ops_waiting=True), Gate(resync_due=True), Gate(paused=True)):
        plan = SCHEDULER.plan([Row()], Lane.SERVING, gate=blocked, serving=SERVING, room=4)
        assert plan.join == () and plan.queue is None


def test_joiners_of_the_running_lane_fill_its_room() -> None:
    queued = [Row(), Row(cancelled=True), Row(), Row(), Row()]
    plan = SCHEDULER.plan(queued, Lane.SERVING, serving=SERVING, room=2)
    assert plan.join == (queued[0], queued[2]) and plan.queue == (queued[3], queued[4])
    peft = [Row("old"), Row(None)]
    assert SCHEDULER.plan(peft, Lane.PEFT, serving=SERVING, room=4).join == tuple(peft)
    assert SCHEDULER.plan(queued, Lane.SERVING, serving=SERVING, room=0).join == ()


def test_a_waiting_row_of_the_other_lane_stops_all_joins_so_no_lane_starves() -> None:
    queued = [Row(), Row("old"), Row(cancelled=True)]
    for lane in (Lane.SERVING, Lane.PEFT):
        plan = SCHEDULER.plan(queued, lane, serving=SERVING, room=4)
        assert plan.join == () and plan.queue == tuple(queued[:2])  # cancelled rows are dropped
    batch = SCHEDULER.lanes(queued[:2], SERVING)  # the next batch takes both, serving copy first
    assert [(p.lane, p.rows, p.joinable) for p in batch] == [
        (Lane.SERVING, (queued[0],), False),
        (Lane.PEFT, (queued[1],), True),
    ]


def test_no_joiners_onto_a_serving_copy_on_stale_weights() -> None:
    queued = [Row(), Row()]
    assert SCHEDULER.plan(queued, Lane.SERVING, serving=Serving("live", stale=True), room=4).join == ()
    assert SCHEDULER.plan(queued, Lane.SERVING, serving=SERVING, room=4).join == tuple(queued)
    peft = [Row("old")]  # the peft lane runs the model itself: never stale
    assert SCHEDULER.plan(peft, Lane.PEFT, serving=Serving("live", stale=True), room=4).join == tuple(peft)


def test_lanes_the_served_adapter_on_the_copy_and_the_prefix_cache_only_there() -> None:
    rows = [Row(), Row(None), Row("old")]
    serving, peft = SCHEDULER.lanes(rows, SERVING)
    assert serving.rows == (rows[0],) and serving.prefix_cache and not serving.joinable
    assert peft.rows == (rows[1], rows[2]) and not peft.prefix_cache and peft.joinable
    (only,) = SCHEDULER.lanes(rows, None)  # no serving copy: everything runs through peft
    assert only.lane is Lane.PEFT and only.rows == tuple(rows)
    (base,) = SCHEDULER.lanes([rows[1]], Serving(None))  # a copy of the base model serves base rows
    assert base.lane is Lane.SERVING and base.joinable


def test_a_shared_prompt_prefix_is_run_once_only_when_long_and_of_one_adapter() -> None:
    prefix = list(range(100, 120))
    rows = [Row(prompt_ids=prefix + [1, 2]), Row(prompt_ids=prefix + [3])]
    assert shared_prompt_length(rows) == 20
    assert shared_prompt_length(rows[:1]) == 0  # one row shares nothing
    assert shared_prompt_length([rows[0], Row("old", prompt_ids=prefix + [3])]) == 0
    assert shared_prompt_length([Row(prompt_ids=prefix), Row(prompt_ids=prefix)]) == 19  # one token each
    assert shared_prompt_length([Row(prompt_ids=prefix[:15] + [1]), Row(prompt_ids=prefix[:15] + [2])]) == 0
