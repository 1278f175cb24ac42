"""Before and after, head to head: does the trained model beat the model it started from?

For each validation prompt both models have answered; the judge (RULER on a group of two)
compares the answers twice, trained first and baseline first, to cancel position bias. Each
order gives the trained answer 1 (scored higher), 0.5 (equal) or 0 (lower); a prompt's outcome
is the mean of its two orders. The win rate is the mean outcome over the prompts judged in both
orders (ties and split verdicts count half), with a Wilson score interval. Identical answers
are a tie without asking the judge. A failed judgement is counted in `judge_errors` and its
prompt left out: never scored as a loss or a tie.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autorl.judge import JudgeConfig, JudgeError
from autorl.ruler import DEFAULT_RUBRIC, TooFewTrajectoriesError, ruler

logger = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, Any]]
Answer = str | Messages
"""A reply's text, or the messages after the prompt (a multi-turn conversation)."""


@dataclass(frozen=True)
class HeadToHead:
    """The trained model against its starting point on the validation prompts."""

    wins: int
    """Prompts where the trained answer won on balance (outcome > 0.5)."""
    losses: int
    """Prompts where the baseline answer won on balance (outcome < 0.5)."""
    ties: int
    """Prompts with outcome 0.5 (equal scores, identical answers, or one win each way)."""
    judge_errors: int
    """Judgements (one per order) that failed; their prompts are left out of the rate."""
    win_rate: float | None
    """Mean outcome over the judged prompts; None when none could be judged."""
    ci_low: float
    """Lower end of the 95% Wilson interval of the win rate (0 with no judged prompt)."""
    ci_high: float
    """Upper end of the 95% Wilson interval (1 with no judged prompt)."""
    outcomes: tuple[float | None, ...] = ()
    """Per prompt, in input order: its outcome, or None when a judgement failed."""

    @property
    def judged(self) -> int:
        return self.wins + self.losses + self.ties


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion `successes / n` (successes may be fractional); pure."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def summarise(outcomes: Sequence[float | None], judge_errors: int) -> HeadToHead:
    """Counts, win rate and interval from per-prompt outcomes; pure."""
    judged = [o for o in outcomes if o is not None]
    wins = sum(1 for o in judged if o > 0.5)
    losses = sum(1 for o in judged if o < 0.5)
    ties = len(judged) - wins - losses
    rate = sum(judged) / len(judged) if judged else None
    low, high = wilson_interval(sum(judged), len(judged))
    return HeadToHead(wins, losses, ties, judge_errors, rate, low, high, tuple(outcomes))


def _as_messages(answer: Answer) -> list[dict[str, Any]]:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    return [dict(m) for m in answer]


def order_outcome(trained_score: float, baseline_score: float) -> float:
    """1 if the trained answer scored higher, 0.5 if equal, 0 if lower; pure."""
    if trained_score > baseline_score:
        return 1.0
    return 0.5 if trained_score == baseline_score else 0.0


async def _judge_pair(
    prompt: Messages, trained: Answer, baseline: Answer, judge: JudgeConfig | str, rubric: str
) -> tuple[float | None, int]:
    """(outcome, failed judgements) for one prompt."""
    a = [*map(dict, prompt), *_as_messages(trained)]
    b = [*map(dict, prompt), *_as_messages(baseline)]
    if a == b:
        return 0.5, 0
    orders: list[float] = []
    errors = 0
    for first_is_trained in (True, False):
        pair = [a, b] if first_is_trained else [b, a]
        try:
            scores = await ruler(pair, judge, rubric)
        except (JudgeError, TooFewTrajectoriesError) as exc:
            logger.warning("head-to-head judgement failed: %s", exc)
            errors += 1
            continue
        trained_score, baseline_score = (scores[0].score, scores[1].score)
        if not first_is_trained:
            trained_score, baseline_score = baseline_score, trained_score
        orders.append(order_outcome(trained_score, baseline_score))
    if errors:
        return None, errors
    return sum(orders) / len(orders), 0


async def head_to_head(
    prompts: Sequence[Messages],
    trained_answers: Sequence[Answer],
    baseline_answers: Sequence[Answer],
    *,
    judge: JudgeConfig | str,
    rubric: str = DEFAULT_RUBRIC,
    concurrency: int = 4,
) -> HeadToHead:
    """Judge each prompt's trained answer against its baseline answer in both orders.

    `prompts` are the messages both models saw (system prompt, first user message); answers are
    texts or the messages that followed. Raises ValueError when the three lists differ in length.
    """
    if not len(prompts) == len(trained_answers) == len(baseline_answers):
        raise ValueError(
            f"head_to_head needs one trained and one baseline answer per prompt, got {len(prompts)} prompts, "
            f"{len(trained_answers)} trained and {len(baseline_answers)} baseline answers"
        )
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[float | None, int]:
        async with semaphore:
            return await _judge_pair(prompts[i], trained_answers[i], baseline_answers[i], judge, rubric)

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return summarise([o for o, _ in results], sum(e for _, e in results))


__all__ = ["HeadToHead", "head_to_head", "order_outcome", "summarise", "wilson_interval"]
