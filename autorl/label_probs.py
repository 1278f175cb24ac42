"""A judge's probability of each answer label ("1".."5", "A"/"B"), read from its top logprobs.

The judge is asked for one token (`max_tokens=1`) with `top_logprobs`; the probabilities of the
label tokens among those alternatives (case and surrounding spaces ignored, so "A" and " A"
add up) are renormalised to sum to 1. The judge's sampled token itself does not matter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autorl.judge import (
    JudgeConfig,
    JudgeError,
    JudgeResponseError,
    answer_cache_key,
    cache_get,
    cache_put,
    complete,
    describe_transport_error,
    is_retryable,
    is_transport_error,
)

logger = logging.getLogger(__name__)


class NoLabelProbabilitiesError(JudgeResponseError):
    """The judge gave no probability for any label: its endpoint returned no logprobs, or none
    of the labels was among its most likely answer tokens."""


def label_probabilities(top: Mapping[str, float], labels: Sequence[str]) -> dict[str, float] | None:
    """P(label) renormalised over the labels found in `top` ({token: logprob}); None if none is."""
    wanted = {label.strip().lower(): label for label in labels}
    mass = dict.fromkeys(labels, 0.0)
    for token, logprob in top.items():
        label = wanted.get(token.strip().lower())
        if label is not None and math.isfinite(logprob):
            mass[label] += math.exp(logprob)
    total = sum(mass.values())
    if total <= 0.0:
        return None
    return {label: p / total for label, p in mass.items()}


def expected_value(probs: Mapping[str, float]) -> float:
    """Sum of int(label) * P(label) for digit labels."""
    return sum(int(label) * p for label, p in probs.items())


@dataclass(frozen=True)
class LabelAnswer:
    """The judge's label probabilities for one question, and what it took to get them."""

    probs: dict[str, float]
    """P(label) for every label, summing to 1."""
    calls: int
    """Judge calls made (0 from the cache)."""
    errors: int
    """Calls that gave no usable answer before this one."""


def _labels_found(answer_top: tuple[dict[str, float], ...] | None, labels: Sequence[str]) -> dict[str, float]:
    if not answer_top:
        raise NoLabelProbabilitiesError(
            "the judge's endpoint returned no logprobs; this mode needs `logprobs`/`top_logprobs` "
            "(use RulerConfig(mode='sampled') for this judge)"
        )
    probs = label_probabilities(answer_top[0], labels)
    if probs is None:
        seen = sorted(answer_top[0], key=lambda t: -answer_top[0][t])[:5]
        raise NoLabelProbabilitiesError(f"none of the labels {list(labels)} is among its top tokens {seen}")
    return probs


async def ask_label_probs(
    config: JudgeConfig,
    messages: list[dict[str, Any]],
    labels: Sequence[str],
    *,
    top_logprobs: int,
    correction: str,
) -> LabelAnswer:
    """Ask (one answer token) until a label has a probability; up to `config.max_attempts` calls.

    A reply without logprobs fails at once (NoLabelProbabilitiesError: retrying cannot help).
    A reply without any label among its top tokens is retried with `correction` appended.
    Transport errors are retried after a backoff when retryable, as in `ask_judge`. Validated
    answers are cached by prompt hash like `ask_judge`'s.
    """
    one_token = dataclasses.replace(config, max_tokens=1)
    key = answer_cache_key(one_token, messages, {"labels": list(labels), "top_logprobs": top_logprobs})
    cached = cache_get(config, key)
    if isinstance(cached, dict) and set(cached) == set(labels):
        return LabelAnswer({k: float(v) for k, v in cached.items()}, 0, 0)
    reasons: list[str] = []
    conversation = messages
    answered = False
    for n in range(1, config.max_attempts + 1):
        try:
            answer = await complete(one_token, conversation, None, top_logprobs=top_logprobs)
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            reasons.append(f"attempt {n}: {describe_transport_error(exc, config)}")
            answered = False
            if not is_retryable(exc):
                break
            if n < config.max_attempts:
                await asyncio.sleep(config.retry_backoff_s * 2 ** (n - 1))
            continue
        try:
            probs = _labels_found(answer.top_logprobs, labels)
        except NoLabelProbabilitiesError as exc:
            reasons.append(f"attempt {n}: {exc}")
            answered = True
            if not answer.top_logprobs:
                break
            conversation = [
                *messages,
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": correction},
            ]
            continue
        cache_put(config, key, probs)
        return LabelAnswer(probs, n, n - 1)
    calls = len(reasons)
    what = "gave no label probabilities" if answered else "could not be called"
    message = f"judge {config.model} {what} in {calls} attempt(s): " + "; ".join(reasons)
    error = NoLabelProbabilitiesError if answered else JudgeError
    raise error(message, reasons, calls=calls)


__all__ = [
    "LabelAnswer",
    "NoLabelProbabilitiesError",
    "ask_label_probs",
    "expected_value",
    "label_probabilities",
]
