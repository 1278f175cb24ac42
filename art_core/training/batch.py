"""From trajectory groups to a training batch: advantages, exact-token sequences, skips, micro-batches.

`prepare_batch` is strict about what the user must fix and explicit about what it skips:
- a missing or non-finite reward raises ValueError naming the group and trajectory (never dropped),
  except in a group whose scoring failed and was counted (`ruler_errors` or `after_each_errors` in
  its metrics, every reward unset): that group is skipped and counted in `groups_unscored`;
- an empty group, a zero-variance group (all rewards equal), a trajectory without trainable tokens
  and a sequence longer than the context are skipped, counted in `metrics` and explained in `warnings`;
- when no trajectory of the whole batch has trainable tokens, `NoTrainableTokensError` is raised,
  because that is a setup problem (client not pointed at our server), not bad luck.
Examples whose advantage is exactly 0 carry no gradient; they are counted and left out.

The loss is normalised over every *scored* sequence (`PreparedBatch.totals`), not only the trained
ones: a zero-variance group's sequences and zero-advantage examples count in `num_sequences` and
`num_tokens` though they add no gradient, as in GRPO's batch mean (and TRL's). So a step in which one
group of eight carries signal moves the weights an eighth as far as one in which all eight do.
`LossConfig.normalise_over="trained"` divides by the trained sequences alone instead.

A trajectory without tokens still counts in its group's baseline: its reward is a real outcome of
the policy (e.g. the agent failed before calling the model), so the others are compared against it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import CONTEXT_LENGTH_EXCEEDED
from art_core.training.advantages import group_advantages, mean_std
from art_core.training.config import LossNormaliser
from art_core.training.logprobs import IGNORE_INDEX
from art_core.training.sequences import NoTrainableTokensError, TokenSequence, trajectory_sequences

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingExample:
    """One sequence to train on with the advantage of the trajectory it came from."""

    sequence: TokenSequence
    """The exact tokens, mask and engine log-probs."""
    advantage: float
    """The trajectory's group-relative advantage (shared by all its sequences)."""
    group_index: int
    """Index of the group in the list given to `prepare_batch`."""
    trajectory_index: int
    """Index of the trajectory within its group."""


@dataclass(frozen=True)
class BatchTotals:
    """Normalisers of a whole optimizer batch, so that micro-batch losses sum to the batch loss."""

    num_sequences: float
    """Number of sequences the loss is averaged over."""
    num_tokens: float
    """Number of masked (sampled, predictable) tokens in those sequences."""
    max_completion_tokens: float
    """The largest number of masked tokens in one of them (Dr. GRPO's constant length)."""

    @classmethod
    def of(cls, examples: Sequence[TrainingExample]) -> BatchTotals:
        """Normalisers over `examples` alone (the trained sequences)."""
        return cls.counting([example.sequence.num_trainable for example in examples])

    @classmethod
    def counting(cls, masked_tokens: Sequence[int]) -> BatchTotals:
        """Normalisers over sequences with these numbers of masked tokens."""
        if not masked_tokens:
            raise ValueError("BatchTotals needs at least one sequence; skip training for an empty batch")
        return cls(float(len(masked_tokens)), float(sum(masked_tokens)), float(max(masked_tokens)))


@dataclass(frozen=True)
class PreparedBatch:
    """The examples to train on, with counts of everything that was skipped and why."""

    examples: list[TrainingExample]
    """Sequences with a non-zero advantage and at least one trainable token."""
    metrics: dict[str, float]
    """Reward statistics and counts: groups_*, trajectories_*, sequences_*, examples*, tokens_trained."""
    warnings: list[str] = field(default_factory=list)
    """One human-readable line per skipped group, trajectory or sequence."""
    scored_tokens: list[int] | None = None
    """Masked tokens of every scored sequence that fits the context: the examples, zero-advantage
    ones and those of zero-variance groups (the loss's normalisers count them all). None (a batch
    built by hand): the examples are all that was scored."""

    @property
    def totals(self) -> BatchTotals:
        """Normalisers over every scored sequence; ValueError when there are none."""
        if self.scored_tokens is None:
            return BatchTotals.of(self.examples)
        if len(self.scored_tokens) < len(self.examples):
            raise ValueError(
                f"{len(self.examples)} examples but {len(self.scored_tokens)} scored sequences: "
                "scored_tokens must list every example's masked tokens and those of the untrained "
                "sequences scored with them"
            )
        return BatchTotals.counting(self.scored_tokens)

    def normalisers(self, over: LossNormaliser) -> BatchTotals:
        """`totals` for over="scored", `BatchTotals.of(examples)` for over="trained"."""
        if over == "trained":
            return BatchTotals.of(self.examples)
        if over == "scored":
            return self.totals
        raise ValueError(f"normalise over 'scored' or 'trained' sequences, got {over!r}")


@dataclass
class _Tally:
    """Mutable counters filled while preparing a batch."""

    counts: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    scored_tokens: list[int] = field(default_factory=list)

    def skip(self, counter: str, message: str, level: int = logging.WARNING) -> None:
        self.counts[counter] = self.counts.get(counter, 0.0) + 1.0
        self.warnings.append(message)
        logger.log(level, message)


_COUNTERS = (
    "groups_total",
    "groups_empty",
    "groups_zero_variance",
    "groups_unscored",
    "groups_trainable",
    "trajectories_total",
    "trajectories_skipped_no_tokens",
    "rollout_exceptions",
    "rollouts_context_exceeded",
    "sequences_total",
    "sequences_scored",
    "sequences_too_long",
    "examples_zero_advantage",
    "examples",
    "tokens_trained",
)


_SCORING_FAILURES = ("ruler_errors", "after_each_errors")
"""Group metrics that mark a group whose scoring failed and was counted (RULER's, the gather's)."""


def unscored(group: TrajectoryGroup) -> bool:
    """Whether the group's scoring failed and was counted, leaving every reward unset: it is skipped
    (`groups_unscored`), never trained on with made-up rewards."""
    failed = any(group.metrics.get(name) for name in _SCORING_FAILURES)
    return failed and all(t.reward is None for t in group.trajectories)


def _checked_rewards(groups: Sequence[TrajectoryGroup]) -> list[list[float]]:
    """Every reward (none for an `unscored` group), or a ValueError that says which trajectory to fix."""
    rewards: list[list[float]] = []
    for gi, group in enumerate(groups):
        if unscored(group):
            rewards.append([])
            continue
        row = []
        for ti, trajectory in enumerate(group.trajectories):
            try:
                row.append(trajectory.checked_reward())
            except ValueError as error:
                raise ValueError(f"group {gi}, trajectory {ti}: {error}") from None
        rewards.append(row)
    return rewards


def _check_token_ids(table: list[list[list[TokenSequence] | None]], vocab_size: int) -> None:
    """ValueError naming the first trajectory with a token id outside [0, vocab_size)."""
    for gi, row in enumerate(table):
        for ti, sequences in enumerate(row):
            for sequence in sequences or []:
                ids = sequence.token_ids
                if ids and not (0 <= min(ids) and max(ids) < vocab_size):
                    bad = next(t for t in ids if not 0 <= t < vocab_size)
                    raise ValueError(
                        f"group {gi}, trajectory {ti}: token id {bad} is outside the model's vocabulary "
                        f"[0, {vocab_size}); train on the token ids this model's server returned"
                    )


def _sequences_or_none(
    groups: Sequence[TrajectoryGroup],
) -> tuple[list[list[list[TokenSequence] | None]], list[tuple[int, int, str]]]:
    """Sequences of every trajectory (None when it has no trainable tokens) and the reasons why."""
    table: list[list[list[TokenSequence] | None]] = []
    missing: list[tuple[int, int, str]] = []
    for gi, group in enumerate(groups):
        row: list[list[TokenSequence] | None] = []
        for ti, trajectory in enumerate(group.trajectories):
            try:
                row.append(trajectory_sequences(trajectory))
            except NoTrainableTokensError as error:
                row.append(None)
                missing.append((gi, ti, str(error)))
        table.append(row)
    return table, missing


def _reward_stats(rewards: list[list[float]]) -> dict[str, float]:
    flat = [r for row in rewards for r in row]
    if not flat:
        return {}
    mean, std = mean_std(flat)
    return {"reward": mean, "reward_std": std}


def prepare_batch(
    groups: Sequence[TrajectoryGroup], *, scale_rewards: bool, max_context: int, vocab_size: int | None = None
) -> PreparedBatch:
    """Compute advantages and exact-token examples for `groups`; see the module docstring for the rules.

    With `vocab_size`, a token id outside [0, vocab_size) is a ValueError (not an index error mid-step).
    """
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2 tokens, got {max_context}")
    rewards = _checked_rewards(groups)
    table, missing = _sequences_or_none(groups)
    if vocab_size is not None:
        _check_token_ids(table, vocab_size)
    n_trajectories = sum(len(row) for row in rewards)
    if n_trajectories > 0 and len(missing) == n_trajectories:
        raise NoTrainableTokensError(
            f"none of the {n_trajectories} trajectories in this batch: {missing[0][2]}"
        )
    tally = _Tally(counts=dict.fromkeys(_COUNTERS, 0.0))
    tally.counts.update(groups_total=float(len(groups)), trajectories_total=float(n_trajectories))
    failures = [info for group in groups for info in group.exceptions]
    tally.counts["rollout_exceptions"] = float(len(failures))
    tally.counts["rollouts_context_exceeded"] = float(
        sum(info.code == CONTEXT_LENGTH_EXCEEDED for info in failures)
    )
    for gi, ti, reason in missing:
        tally.skip("trajectories_skipped_no_tokens", f"group {gi}, trajectory {ti} skipped: {reason}")
    examples: list[TrainingExample] = []
    for gi, row in enumerate(rewards):
        examples.extend(
            _group_examples(gi, row, table[gi], scale_rewards, max_context, tally, unscored(groups[gi]))
        )
    if not groups:
        tally.warnings.append("no groups were given, so there is nothing to train on")
    tally.counts["examples"] = float(len(examples))
    tally.counts["tokens_trained"] = float(sum(example.sequence.num_trainable for example in examples))
    tally.counts["sequences_scored"] = float(len(tally.scored_tokens))
    return PreparedBatch(
        examples, {**_reward_stats(rewards), **tally.counts}, tally.warnings, tally.scored_tokens
    )


def _group_examples(
    gi: int,
    rewards: list[float],
    sequences: list[list[TokenSequence] | None],
    scale_rewards: bool,
    max_context: int,
    tally: _Tally,
    unscored_group: bool = False,
) -> list[TrainingExample]:
    """The examples of one group, recording every skip in `tally`."""
    if not rewards and unscored_group:
        tally.skip(
            "groups_unscored",
            f"group {gi} skipped: its scoring failed (counted in judge_errors/ruler_errors), so it has no rewards",
        )
        return []
    if not rewards:
        tally.skip("groups_empty", f"group {gi} skipped: it has no trajectories (did every rollout fail?)")
        return []
    result = group_advantages(rewards, scale=scale_rewards)
    if result.zero_variance:
        tally.scored_tokens.extend(
            seq.num_trainable for seqs in sequences for seq in seqs or [] if len(seq) <= max_context
        )
        tally.skip(
            "groups_zero_variance",
            f"group {gi} skipped: all {len(rewards)} rewards equal {rewards[0]!r} (zero variance, no signal); "
            "use more rollouts per group or a reward that separates them",
            level=logging.INFO,  # routine in GRPO; counted, and the step warns if nothing trains
        )
        return []
    examples = []
    for ti, (advantage, seqs) in enumerate(zip(result.advantages, sequences, strict=True)):
        for si, seq in enumerate(seqs or []):
            tally.counts["sequences_total"] += 1
            if len(seq) > max_context:
                tally.skip(
                    "sequences_too_long",
                    f"group {gi}, trajectory {ti}, sequence {si} skipped: {len(seq)} tokens exceed the "
                    f"model's context of {max_context}; shorten rollouts (max_tokens, fewer turns)",
                )
            else:
                tally.scored_tokens.append(seq.num_trainable)
                if advantage == 0.0:
                    tally.counts["examples_zero_advantage"] += 1
                else:
                    examples.append(TrainingExample(seq, advantage, gi, ti))
    if examples:
        tally.counts["groups_trainable"] += 1
    return examples


def micro_batches(
    examples: Sequence[TrainingExample], micro_batch_tokens: int
) -> list[list[TrainingExample]]:
    """Split examples into micro-batches of at most `micro_batch_tokens` padded tokens.

    Examples are sorted longest first (ties keep their order), and each micro-batch holds as many as
    fit when padded to its first (longest) one. A sequence longer than the budget gets a
    micro-batch of its own: nothing is dropped or truncated here.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    ordered = sorted(examples, key=lambda example: -len(example.sequence))
    batches: list[list[TrainingExample]] = []
    for example in ordered:
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].sequence) <= micro_batch_tokens:
            batches[-1].append(example)
        else:
            batches.append([example])
    return batches


def group_micro_batches(
    groups: Sequence[Sequence[TrainingExample]], micro_batch_tokens: int, pack_tokens: int
) -> list[list[TrainingExample]]:
    """Micro-batches of whole groups, in order: a group joins the current one while its
    `packed_tokens` stay within `pack_tokens` and its padded tokens (rows x the longest sequence)
    within `micro_batch_tokens`; a group over `micro_batch_tokens` alone is split by `micro_batches`.
    Nothing is dropped: every example lands in exactly one micro-batch."""
    if micro_batch_tokens < 1 or pack_tokens < 1:
        raise ValueError(f"budgets must be >= 1, got {micro_batch_tokens} and {pack_tokens}")
    batches: list[list[TrainingExample]] = []
    current: list[list[TrainingExample]] = []
    for group in groups:
        merged = [*current, list(group)]
        if current and (_padded_tokens(merged) > micro_batch_tokens or packed_tokens(merged) > pack_tokens):
            batches.append([e for g in current for e in g])
            merged = [list(group)]
        if _padded_tokens(merged) > micro_batch_tokens:
            batches.extend(micro_batches(merged[0], micro_batch_tokens))
            merged = []
        current = merged
    if current:
        batches.append([e for g in current for e in g])
    return batches


def _padded_tokens(groups: Sequence[Sequence[TrainingExample]]) -> int:
    examples = [e for g in groups for e in g]
    return len(examples) * max(len(e.sequence) for e in examples)


def packed_tokens(groups: Sequence[Sequence[TrainingExample]]) -> int:
    """Tokens one pass of the packed forward computes for these groups in one micro-batch: the
    prefix common to all inputs once, each group's common run past it (padded to the longest)
    once per group, and every row's own tokens padded to the longest (`packed_forward.TokenTree`).
    A budget's estimate: a common prefix under the forward's minimum (`MIN_SHARED_PREFIX`) is counted
    once here though the pass runs it per row."""
    inputs = [[e.sequence.token_ids[:-1] for e in g] for g in groups]
    rows = [seq for g in inputs for seq in g]
    prefix = _common_length(rows) if len(rows) > 1 else 0
    runs = [_common_length(g) - prefix if len(g) > 1 else 0 for g in inputs]
    own = max(len(seq) - prefix - run for g, run in zip(inputs, runs, strict=True) for seq in g)
    return prefix + len(groups) * max(runs) + len(rows) * own


def _common_length(rows: Sequence[Sequence[int]]) -> int:
    """Leading tokens common to all `rows`, leaving each at least one of its own."""
    shortest = min(len(row) for row in rows)
    common = 0
    while common < shortest - 1 and all(row[common] == rows[0][common] for row in rows):
        common += 1
    return common


def collate(examples: Sequence[TrainingExample], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors for one micro-batch; position t of the inputs predicts target t.

    Returns input_ids/attention_mask/targets [B, T] (long; inputs padded with `pad_id`, targets with
    `IGNORE_INDEX`, whose log-prob is 0), mask [B, T] float (1 on trained targets), engine_logprobs [B, T] float32 (NaN where unknown or padding), advantages [B] float32,
    groups [B] long (each example's `group_index`: rows of a group share their prompt), where T is
    the longest sequence length minus one.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    width = max(len(example.sequence) for example in examples) - 1
    if width < 1:
        raise ValueError("every sequence is a single token; nothing can be predicted")
    shape = (len(examples), width)
    batch = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "targets": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
        "mask": torch.zeros(shape, dtype=torch.float32),
        "engine_logprobs": torch.full(shape, math.nan, dtype=torch.float32),
        "advantages": torch.tensor([example.advantage for example in examples], dtype=torch.float32),
        "groups": torch.tensor([example.group_index for example in examples], dtype=torch.long),
    }
    for row, example in enumerate(examples):
        seq = example.sequence
        n = len(seq) - 1
        batch["input_ids"][row, :n] = torch.tensor(seq.token_ids[:-1], dtype=torch.long)
        batch["attention_mask"][row, :n] = 1
        batch["targets"][row, :n] = torch.tensor(seq.token_ids[1:], dtype=torch.long)
        batch["mask"][row, :n] = torch.tensor(seq.mask[1:], dtype=torch.float32)
        batch["engine_logprobs"][row, :n] = torch.tensor(seq.logprobs[1:], dtype=torch.float32)
    return batch
