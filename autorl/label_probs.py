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
    JudgeAnswer,
    JudgeConfig,
    JudgeError,
    JudgeResponseError,
    answer_cache_key,
    cache_get,
    cache_put,
    complete,
)
from autorl.retries import Attempts, Rejected, ask_with_retries

logger = logging.getLogger(__name__)


class NoLabelProbabilitiesError(JudgeResponseError):
    """The judge gave no probability for any label: its endpoint returned no logprobs, or none
    of the labels was among its most likely answer tokens."""


class NoLogprobsError(NoLabelProbabilitiesError):
    """The judge's endpoint returned no logprobs at all (remembered per endpoint: `gives_no_logprobs`)."""


_NO_LOGPROBS: set[tuple[str, str | None]] = set()
"""Judge endpoints (model, URL) that answered without logprobs in this process."""

_WITH_LOGPROBS: set[tuple[str, str | None]] = set()
"""Judge endpoints that answered with logprobs in this process."""


def gives_no_logprobs(config: JudgeConfig) -> bool:
    """Whether this judge endpoint already answered without logprobs in this process."""
    return (config.model, config.endpoint) in _NO_LOGPROBS


def logprobs_known(config: JudgeConfig) -> bool:
    """Whether this judge endpoint already answered with logprobs in this process."""
    return (config.model, config.endpoint) in _WITH_LOGPROBS


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
        raise NoLogprobsError(
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
    endpoint = (config.model, config.endpoint)

    def accept(answer: JudgeAnswer, so_far: Attempts) -> dict[str, float]:
        (_WITH_LOGPROBS if answer.top_logprobs else _NO_LOGPROBS).add(endpoint)
        try:
            probs = _labels_found(answer.top_logprobs, labels)
        except NoLogprobsError as exc:  # retrying cannot help
            reasons = [*so_far.reasons, f"attempt {so_far.calls + 1}: {exc}"]
            message = f"judge {config.model} gave no label probabilities: {exc}"
            raise NoLogprobsError(message, reasons, calls=len(reasons)) from None
        except NoLabelProbabilitiesError as exc:
            raise Rejected(str(exc)) from None
        cache_put(config, key, probs)
        return probs

    def fail(attempts: Attempts) -> JudgeError:
        what = "gave no label probabilities" if attempts.answered else "could not be called"
        message = f"judge {config.model} {what} in {attempts.calls} attempt(s): {attempts.summary()}"
        error = NoLabelProbabilitiesError if attempts.answered else JudgeError
        return error(message, attempts.reasons, calls=attempts.calls)

    probs, calls = await ask_with_retries(
        config,
        messages,
        lambda conversation: complete(one_token, conversation, None, top_logprobs=top_logprobs),
        accept,
        correction=lambda _: correction,
        fail=fail,
    )
    return LabelAnswer(probs, calls, calls - 1)


async def ask_labels_all(
    config: JudgeConfig,
    prompts: Sequence[list[dict[str, Any]]],
    labels: Sequence[str],
    *,
    top_logprobs: int,
    correction: str,
    max_concurrency: int,
) -> list[LabelAnswer | JudgeError]:
    """`ask_label_probs` for every prompt, `max_concurrency` at a time; failures are returned, not
    raised. An endpoint not yet seen to give logprobs is asked the first prompt alone first, and
    one that gives none raises NoLogprobsError after that single call."""
    limit = asyncio.Semaphore(max_concurrency)

    async def one(prompt: list[dict[str, Any]]) -> LabelAnswer | JudgeError:
        async with limit:
            try:
                return await ask_label_probs(
                    config, prompt, labels, top_logprobs=top_logprobs, correction=correction
                )
            except NoLogprobsError:
                raise
            except JudgeError as exc:
                return exc

    if not prompts:
        return []
    first: list[LabelAnswer | JudgeError] = []
    if not logprobs_known(config):
        first = [await one(prompts[0])]
    return first + list(await asyncio.gather(*(one(p) for p in prompts[len(first) :])))


__all__ = [
    "LabelAnswer",
    "NoLabelProbabilitiesError",
    "NoLogprobsError",
    "ask_labels_all",
    "gives_no_logprobs",
    "logprobs_known",
    "ask_label_probs",
    "expected_value",
    "label_probabilities",
]
