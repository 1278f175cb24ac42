"""Pairwise RULER scores: P("A") against P("B") for every pair, both orders, then Bradley-Terry.

For each pair (i, j) of distinct trajectories the judge sees the shared context and the two
replies, once with i as A and once with j as A, and answers one letter; `autorl.label_probs`
reads P(A) and P(B) from its top logprobs. The soft wins (i beats j with P(i's letter)) are
combined by `autorl.bradley_terry`, and a trajectory's score is its mean Bradley-Terry
probability of beating each other one. A pair whose two calls both failed makes the group fail;
a pair with one failed order is scored from the other (the failure is counted).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from autorl.bradley_terry import bradley_terry, win_probabilities
from autorl.judge import JudgeConfig, JudgeError
from autorl.judging import Judgement, RulerConfig, TrajectoryScore
from autorl.label_probs import LabelAnswer, ask_label_probs
from autorl.transcript import context_text, reply_text, shared_context_length, tools_text

SYSTEM_PROMPT = """\
Grading standards:
{rubric}"""
"""The pairwise judge's system prompt; `{rubric}` is replaced by the grading standards."""

LABELS = ("A", "B")


def build_pairwise_messages(
    context: Sequence[Mapping[str, Any]],
    reply_a: Sequence[Mapping[str, Any]],
    reply_b: Sequence[Mapping[str, Any]],
    rubric: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages asking which of two replies (after the shared `context`) is better; pure."""
    blocks = [text for text in (tools_text(tools), context_text(context)) if text]
    blocks.append(f"Reply A: {reply_text(reply_a)}")
    blocks.append(f"Reply B: {reply_text(reply_b)}")
    body = "\n\n".join(blocks) + "\n\nWhich reply is better, A or B? Answer with one letter."
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": body},
    ]


def soft_wins(n: int, preferences: Mapping[tuple[int, int], float]) -> list[list[float]]:
    """The wins matrix from P(first beats second) per ordered (shown-as-A, shown-as-B) pair."""
    wins = [[0.0] * n for _ in range(n)]
    for (a, b), p_a in preferences.items():
        wins[a][b] += p_a
        wins[b][a] += 1.0 - p_a
    return wins


def pairwise_scores(n: int, preferences: Mapping[tuple[int, int], float]) -> list[float]:
    """Each item's mean Bradley-Terry probability of beating the others; pure."""
    return win_probabilities(bradley_terry(soft_wins(n, preferences)))


async def judge_pairwise(
    message_lists: Sequence[Sequence[Mapping[str, Any]]],
    judge: JudgeConfig,
    rubric: str,
    tools: Sequence[Mapping[str, Any]] | None,
    settings: RulerConfig,
) -> Judgement:
    """Scores for distinct `message_lists` (ids "1".."N"); raises JudgeError if a pair has no verdict."""
    n = len(message_lists)
    if n == 1:
        return Judgement([TrajectoryScore("1", 0.5, "the only distinct trajectory")], 0, 1, mode="pairwise")
    prefix = shared_context_length(message_lists)
    context = message_lists[0][:prefix]
    correction = "Answer with the single letter A or B and nothing else."
    limit = asyncio.Semaphore(settings.max_concurrency)
    orders = [o for i, j in itertools.combinations(range(n), 2) for o in ((i, j), (j, i))]

    async def one(a: int, b: int) -> LabelAnswer | JudgeError:
        prompt = build_pairwise_messages(
            context, message_lists[a][prefix:], message_lists[b][prefix:], rubric, tools
        )
        async with limit:
            try:
                return await ask_label_probs(
                    judge, prompt, LABELS, top_logprobs=settings.top_logprobs, correction=correction
                )
            except JudgeError as exc:
                return exc

    results = dict(zip(orders, await asyncio.gather(*(one(a, b) for a, b in orders)), strict=True))
    calls = sum(r.calls for r in results.values())
    errors = sum(r.errors for r in results.values())
    preferences = {o: r.probs["A"] for o, r in results.items() if isinstance(r, LabelAnswer)}
    unjudged = [
        (i, j)
        for i, j in itertools.combinations(range(n), 2)
        if (i, j) not in preferences and (j, i) not in preferences
    ]
    if unjudged:
        i, j = unjudged[0]
        first = results[(i, j)]
        assert isinstance(first, JudgeError)
        failures = [r for r in results.values() if isinstance(r, JudgeError)]
        raise type(first)(
            f"pairwise judge gave no verdict on {len(unjudged)} of {n * (n - 1) // 2} pairs "
            f"(trajectories {i + 1} and {j + 1}: {first})",
            [a for r in failures for a in r.attempts],
            calls=calls,
            errors=errors,
        ) from first
    scores = pairwise_scores(n, preferences)
    out = [
        TrajectoryScore(str(i + 1), s, f"pairwise score {s:.3f} (mean Bradley-Terry win probability)")
        for i, s in enumerate(scores)
    ]
    return Judgement(out, calls, n, errors=errors, mode="pairwise")


__all__ = [
    "LABELS",
    "SYSTEM_PROMPT",
    "build_pairwise_messages",
    "judge_pairwise",
    "pairwise_scores",
    "soft_wins",
]
