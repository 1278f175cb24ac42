"""Probability-weighted RULER scores (G-Eval style): one answer token per trajectory, read as a distribution.

Each distinct trajectory is shown alone after the group's shared context, and the judge answers
one label of `RulerConfig.scale` (worst first: "No"/"Yes" by default, or digits such as "1".."5");
the score is the label's expected position under the judge's top logprobs, mapped to [0, 1]
(`autorl.label_probs`). A small judge that always samples "No" still puts more probability on
"Yes" for better replies, so the group keeps its order. Prompts are pure and golden-tested.

The prompt was chosen with bench/ruler_agreement.py on SmolLM2-135M: plain text (not JSON), the
user turn as "Question:", an empty reply as "(no reply)", and a yes/no question did best.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from autorl.judge import JudgeConfig, JudgeError
from autorl.judging import Judgement, RulerConfig, TrajectoryScore
from autorl.label_probs import LabelAnswer, ask_label_probs
from autorl.transcript import context_text, reply_text, shared_context_length, tools_text

SYSTEM_PROMPT = """Grading standards:
{rubric}"""
"""The weighted judge's system prompt; `{rubric}` is replaced by the grading standards."""


def scale_question(scale: Sequence[str]) -> str:
    """What the judge is asked last: a yes/no question for ("No", "Yes"), else a rating."""
    if [label.lower() for label in scale] == ["no", "yes"]:
        return "Does the reply correctly answer the question? Answer Yes or No."
    shown = ", ".join(scale)
    return (
        f"How good is the reply, from {scale[0]} (worst) to {scale[-1]} (best)? Answer with one of: {shown}."
    )


def build_weighted_messages(
    context: Sequence[Mapping[str, Any]],
    reply: Sequence[Mapping[str, Any]],
    rubric: str,
    scale: Sequence[str],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages asking for one label on `reply` (what follows the shared `context`); pure."""
    blocks = [text for text in (tools_text(tools), context_text(context)) if text]
    blocks.append(f"Reply: {reply_text(reply)}")
    body = "\n".join(blocks) + "\n\n" + scale_question(scale)
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": body},
    ]


def weighted_score(probs: Mapping[str, float], scale: Sequence[str]) -> float:
    """The expected label position, 0 for the first label ... 1 for the last; pure."""
    value = sum(k * probs.get(label, 0.0) for k, label in enumerate(scale)) / (len(scale) - 1)
    return min(1.0, max(0.0, value))


def _explanation(probs: Mapping[str, float], score: float) -> str:
    shown = ", ".join(f"{label}: {p:.3f}" for label, p in probs.items())
    return f"probability-weighted score {score:.3f} (judge's P {shown})"


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
    labels = list(settings.scale)
    correction = f"Answer with one word: {' or '.join(labels)}."
    limit = asyncio.Semaphore(settings.max_concurrency)

    async def one(messages: Sequence[Mapping[str, Any]]) -> LabelAnswer | JudgeError:
        prompt = build_weighted_messages(
            messages[:prefix], messages[prefix:], rubric, labels, tools
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
        score = weighted_score(answer.probs, labels)
        scores.append(TrajectoryScore(str(i), score, _explanation(answer.probs, score)))
    errors = sum(a.errors for a in answers)
    return Judgement(scores, calls, len(answers), errors=errors, mode="weighted")


__all__ = ["SYSTEM_PROMPT", "build_weighted_messages", "judge_weighted", "scale_question", "weighted_score"]
