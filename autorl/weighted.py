"""Probability-weighted RULER scores (G-Eval style): one digit per trajectory, read as a distribution.

Each distinct trajectory is shown alone (after the group's shared context), and the judge is
asked for one digit from 1 to `scale_max`; the score is (E[digit] - 1) / (scale_max - 1) under
the judge's top logprobs (`autorl.label_probs`). Prompts are pure and golden-tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from autorl.judge import JudgeConfig, JudgeError
from autorl.judging import Judgement, RulerConfig, TrajectoryScore
from autorl.label_probs import LabelAnswer, ask_label_probs, expected_value
from autorl.transcript import plain_text, shared_context_length, tools_text

SYSTEM_PROMPT = """\
You grade the reply of an AI assistant. Read the conversation, then the reply, and rate how well \
the reply does what the conversation asks.

Grading standards:
{rubric}

Answer with one digit from 1 to {top}: 1 means useless, wrong or empty, {top} means fully correct and helpful."""
"""The weighted judge's system prompt; `{rubric}` and `{top}` (the scale's top digit) are filled in."""


def scale_labels(scale_max: int) -> list[str]:
    """The digit labels "1".."scale_max"."""
    return [str(k) for k in range(1, scale_max + 1)]


def build_weighted_messages(
    context: Sequence[Mapping[str, Any]],
    reply: Sequence[Mapping[str, Any]],
    rubric: str,
    scale_max: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages asking for one digit on `reply` (what follows the shared `context`); pure."""
    blocks = []
    if tools:
        blocks.append(f"<tools>\n{tools_text(tools)}\n</tools>")
    if context:
        blocks.append(f"<conversation>\n{plain_text(context)}\n</conversation>")
    blocks.append(f"<reply>\n{plain_text(reply)}\n</reply>")
    blocks.append(f"Rate the reply from 1 to {scale_max}. Answer with one digit.")
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip(), top=scale_max)},
        {"role": "user", "content": "\n\n".join(blocks)},
    ]


def weighted_score(probs: Mapping[str, float], scale_max: int) -> float:
    """(E[digit] - 1) / (scale_max - 1), in [0, 1]."""
    return min(1.0, max(0.0, (expected_value(probs) - 1.0) / (scale_max - 1)))


def _explanation(probs: Mapping[str, float], score: float) -> str:
    shown = ", ".join(f"{label}: {p:.2f}" for label, p in probs.items())
    return f"probability-weighted score {score:.3f} (P(digit) {shown})"


async def judge_weighted(
    message_lists: Sequence[Sequence[Mapping[str, Any]]],
    judge: JudgeConfig,
    rubric: str,
    tools: Sequence[Mapping[str, Any]] | None,
    settings: RulerConfig,
) -> Judgement:
    """Scores for distinct `message_lists` (ids "1".."N"); raises JudgeError if any cannot be scored,
    with `calls` counting every call made for the group."""
    prefix = shared_context_length(message_lists)
    labels = scale_labels(settings.scale_max)
    correction = f"Answer with a single digit from 1 to {settings.scale_max} and nothing else."
    limit = asyncio.Semaphore(settings.max_concurrency)

    async def one(messages: Sequence[Mapping[str, Any]]) -> LabelAnswer | JudgeError:
        prompt = build_weighted_messages(
            messages[:prefix], messages[prefix:], rubric, settings.scale_max, tools
        )
        async with limit:
            try:
                return await ask_label_probs(
                    judge, prompt, labels, top_logprobs=settings.top_logprobs, correction=correction
                )
            except JudgeError as exc:
                return exc

    results = await asyncio.gather(*(one(m) for m in message_lists))
    calls = sum(r.calls for r in results)
    failed = [(i, r) for i, r in enumerate(results, start=1) if isinstance(r, JudgeError)]
    if failed:
        errors = sum(r.calls if isinstance(r, JudgeError) else r.errors for r in results)
        first = failed[0][1]
        raise type(first)(
            f"weighted judge failed on {len(failed)} of {len(results)} trajectories "
            f"(trajectory {failed[0][0]}: {first})",
            [a for _, r in failed for a in r.attempts],
            calls=calls,
            errors=errors,
        ) from first
    answers = [r for r in results if isinstance(r, LabelAnswer)]
    scores = []
    for i, answer in enumerate(answers, start=1):
        score = weighted_score(answer.probs, settings.scale_max)
        scores.append(TrajectoryScore(str(i), score, _explanation(answer.probs, score)))
    errors = sum(a.errors for a in answers)
    return Judgement(scores, calls, len(answers), errors=errors, mode="weighted")


__all__ = ["SYSTEM_PROMPT", "build_weighted_messages", "judge_weighted", "scale_labels", "weighted_score"]
