"""Exact-token training sequences built from the token records of a trajectory.

Token in, token out: we never re-tokenise text. Every sampled turn carries the prompt ids the
engine conditioned on and the completion ids it sampled. Consecutive turns are merged into one
sequence when the next turn's prompt starts with everything the sequence holds so far (the
previous prompt + completion, and the turns merged before it); the new prompt tokens beyond that
(a tool result, the next user message, the chat template's glue) are appended as context. When
the prefix differs in any token (a chat template that re-renders the assistant message
differently, a truncated or summarised history) the turn starts a new sequence, which shares the
trajectory's advantage.

Mask 1 lies exactly on sampled tokens. Prompt, tool and re-rendered tokens are context (mask 0):
tokens that did not come from our server are never trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from art_core.rollouts.records import Trajectory, Turn

_NAN = math.nan


class NoTrainableTokensError(ValueError):
    """A trajectory (or a whole batch) holds no token that our server sampled, so nothing can be trained."""


@dataclass(frozen=True)
class TokenSequence:
    """One training sequence: token ids, which of them were sampled, and the engine's log-probs."""

    token_ids: tuple[int, ...]
    """Every token of the conversation in order: prompt, completions, tool results."""
    mask: tuple[int, ...]
    """1 exactly on sampled (completion) tokens, 0 on prompt, context and tool tokens."""
    logprobs: tuple[float, ...]
    """The engine's log-prob of each sampled token where mask is 1; NaN elsewhere."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"TokenSequence fields must have equal lengths, got token_ids={n}, "
                f"mask={len(self.mask)}, logprobs={len(self.logprobs)}"
            )
        if any(m not in (0, 1) for m in self.mask):
            raise ValueError("TokenSequence.mask may only hold 0 and 1")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_trainable(self) -> int:
        """Masked tokens that can be trained: all but a masked first token, which nothing predicts."""
        return sum(self.mask[1:])


@dataclass
class _Builder:
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]

    @classmethod
    def empty(cls) -> _Builder:
        return cls([], [], [])

    def extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [_NAN] * len(ids))

    def continues_with(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.token_ids)
        return n > 0 and len(prompt_ids) >= n and list(prompt_ids[:n]) == self.token_ids

    def build(self) -> TokenSequence:
        return TokenSequence(tuple(self.token_ids), tuple(self.mask), tuple(self.logprobs))


def turns_to_sequences(turns: Sequence[Turn]) -> list[TokenSequence]:
    """Merge turns into sequences by exact prefix; see the module docstring for the rule.

    Returns one sequence per maximal run of turns whose prompts extend each other exactly,
    including sequences whose completions are all empty (callers decide what to do with those).
    """
    sequences: list[TokenSequence] = []
    current = _Builder.empty()
    for turn in turns:
        if current.continues_with(turn.prompt_ids):
            extra = turn.prompt_ids[len(current.token_ids) :]
        else:
            if current.token_ids:
                sequences.append(current.build())
            current = _Builder.empty()
            extra = turn.prompt_ids
        current.extend(extra, 0)
        current.extend(turn.completion_ids, 1, turn.logprobs)
    if current.token_ids:
        sequences.append(current.build())
    return sequences


def trajectory_sequences(trajectory: Trajectory) -> list[TokenSequence]:
    """The trainable sequences of a trajectory: its main turns, then each additional history's.

    Sequences without a trainable token (only empty completions) are left out. Raises
    `NoTrainableTokensError` when nothing is left, with the likely cause in the message.
    """
    histories = [trajectory.turns, *(history.turns for history in trajectory.additional_histories)]
    sequences = [seq for turns in histories for seq in turns_to_sequences(turns)]
    trainable = [seq for seq in sequences if seq.num_trainable > 0]
    if trainable:
        return trainable
    if not any(histories) and trajectory.untrained_choices:
        raise NoTrainableTokensError(
            "trajectory has no token records, so there is nothing to train on: "
            + "; ".join(trajectory.untrained_choices)
            + ". Token records come only from completions served by our server, which adds those fields "
            "to every choice"
        )
    if not any(histories):
        raise NoTrainableTokensError(
            "trajectory has no token records, so there is nothing to train on. Token records come only "
            "from completions served by our server: check that the agent's client points at "
            "`model.openai_client()` / the model's base URL (not another provider), that assistant replies "
            "are added as the returned Choice (`messages_and_choices=[..., choice]` or "
            "`trajectory.add_choice(choice)`) rather than as message dicts, and that LLM calls happen "
            "inside the rollout scope"
        )
    raise NoTrainableTokensError(
        f"trajectory has {sum(len(turns) for turns in histories)} token record(s) but every sampled "
        "completion is empty (e.g. max_tokens=0 or an immediate stop), so there is nothing to train on"
    )
