"""The history.jsonl record of one train step, under the names ART users know.

`train_record` is pure: it takes the step's groups, the batch's and the trainer's counters and the
phase timings, and returns one flat dict. Beside our own keys (`train/groups_*`, `loss/*`) it holds
ART 0.5's names:

| key                                   | what                                                          |
|---------------------------------------|---------------------------------------------------------------|
| `train/reward`, `train/reward_std_dev`| mean reward; mean within-group (population) std of the reward |
| `train/<metric>`                      | mean of each trajectory metric                                |
| `train/exception_rate`                | failed rollouts / (failed + finished)                         |
| `train/judge_calls`, `/judge_errors`  | summed from the groups' metrics where RULER scored them       |
| `train/ruler_errors`                  | groups RULER could not score (skipped: `train/groups_unscored`)|
| `train/server_failures`               | rollouts whose MCP server failed (taken out by `split_failed`)|
| `train/rollout_exceptions`            | failed rollouts (`train/groups_empty`: groups left with none) |
| `train/rollouts_context_exceeded`     | of those, prompts that did not fit the context (a 400)        |
| `data/step_num_groups_submitted`      | groups passed to `train`                                      |
| `data/step_num_groups_trainable`      | groups with a reward spread (a training signal)               |
| `data/step_num_trajectories`          | trajectories passed to `train`                                |
| `data/step_trainer_tokens`            | tokens the loss was computed on                               |
| `data/step_num_gradient_steps`        | optimizer steps taken (1, or 0 when nothing trained)          |
| `loss/train`, `loss/entropy`          | the loss; mean entropy of the policy over trained tokens      |
| `loss/kl_policy_ref`                  | KL to the base model (only when `kl_coef` > 0)                |
| `loss/grad_norm`, `loss/learning_rate`| gradient norm before clipping; learning rate of the step      |
| `time/rollout_s`                      | earliest trajectory start to the train call (rollouts and any |
|                                       | scoring between them)                                         |
| `time/train_s`, `time/publish_s`,     | forward/backward + optimizer; making the new weights served;  |
| `time/checkpoint_s`, `time/step_s`    | the step's commit (trajectories + checkpoint); the whole      |
|                                       | `train` call                                                  |
| `time/checkpoint_wait_s`              | background commit only: how long this `train` call waited for |
|                                       | the previous step's commit (the part of it not overlapped)    |
| `time/remerge_s`                      | one torch engine: its serving copy's merge of this step's     |
|                                       | weights (part of `time/publish_s`: the engine resumes after   |
|                                       | it), plus any merge between train calls; 0.0 after a step     |
|                                       | that trained nothing                                          |

With the background commit (`TorchServing.overlap_checkpoint`, the default for in-process calls)
step n's `time/checkpoint_s` runs during step n+1's rollouts and is not in step n's `time/step_s`;
step n+1's `time/checkpoint_wait_s` is the part of it that still held training up, so
`checkpoint_s(n) - checkpoint_wait_s(n+1)` overlapped (`overlapped_checkpoint_seconds`). Without
it (`art serve`'s route, vLLM, overlap off) the commit is inside `time/step_s` and there is no
`time/checkpoint_wait_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.summary import split_metrics

_ART_DATA = {
    "data/step_num_groups_submitted": "groups_total",
    "data/step_num_groups_trainable": "groups_trainable",
    "data/step_num_trajectories": "trajectories_total",
    "data/step_trainer_tokens": "tokens_trained",
}
_ART_LOSS = {"loss/train": "loss", "loss/kl_policy_ref": "kl"}


class PhaseTimer:
    """Wall-clock seconds per named phase of a step; a phase timed twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def rollout_seconds(groups: Sequence[TrajectoryGroup], now: float) -> dict[str, float]:
    """`{"rollout": seconds from the earliest trajectory's start_time (wall clock) to now}`; `{}`
    when there is no trajectory (then the record has no `time/rollout_s`)."""
    starts = [t.start_time for g in groups for t in g.trajectories]
    return {"rollout": max(now - min(starts), 0.0)} if starts else {}


def overlapped_checkpoint_seconds(history: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(checkpoint seconds, of them overlapped with the next step's rollouts) summed over the train
    lines of `history` in order: a step's commit overlapped by its `time/checkpoint_s` less the
    next line's `time/checkpoint_wait_s`. A step with no next wait (the last one, written during
    `close`, or a synchronous commit) counts as not overlapped."""
    lines = [h for h in history if "trained" in h and "time/checkpoint_s" in h]
    total = sum(float(h["time/checkpoint_s"]) for h in lines)
    overlapped = 0.0
    for line, after in zip(lines, lines[1:], strict=False):
        if "time/checkpoint_wait_s" in after:
            seconds = float(line["time/checkpoint_s"])
            overlapped += max(seconds - float(after["time/checkpoint_wait_s"]), 0.0)
    return total, overlapped


def train_record(
    step: int,
    groups: Sequence[TrajectoryGroup],
    batch_metrics: Mapping[str, float],
    train_metrics: Mapping[str, float],
    seconds: Mapping[str, float],
) -> dict[str, Any]:
    """One history line for a train step (see the module docstring for the keys).

    `seconds` maps phases (`rollout`, `remerge`, `train`, `publish`, `checkpoint`,
    `checkpoint_wait`, `step`) to wall time.
    """
    trained = bool(train_metrics.get("trained", 0))
    record: dict[str, Any] = {"step": step, **split_metrics(groups, "train")}
    record.update({f"train/{k}": float(v) for k, v in batch_metrics.items()})
    record.update({f"loss/{k}": float(v) for k, v in train_metrics.items()})
    record.update(
        {art: float(batch_metrics[ours]) for art, ours in _ART_DATA.items() if ours in batch_metrics}
    )
    record["data/step_num_gradient_steps"] = float(trained)
    record.update(
        {art: float(train_metrics[ours]) for art, ours in _ART_LOSS.items() if ours in train_metrics}
    )
    record.update({f"time/{phase}_s": float(value) for phase, value in seconds.items()})
    record["trained"] = int(trained)
    return record
