"""How RULER's judge turns a group into scores: the judging modes, their config and results.

- "sampled" (OpenPipe ART's RULER): one call; the judge writes JSON with an explanation and a
  number in [0, 1] for every trajectory. Needs a judge that follows instructions well.
- "weighted" (G-Eval style): one call per distinct trajectory; the judge answers one token of a
  fixed scale (`RulerConfig.scale`: "No"/"Yes" by default, or digits), and the score is the
  label's expected position under the judge's own top logprobs, in [0, 1]. A small judge that
  samples "No" for everything still puts more probability on "Yes" for better replies, so the
  group keeps a signal.
- "pairwise": two calls per pair of distinct trajectories (both orders, cancelling position
  bias); each call reads P("A") against P("B") from the top logprobs, and Bradley-Terry
  combines the soft wins into strengths; a trajectory's score is its mean probability of
  beating each other one (in (0, 1)).

In every mode only the order within the group matters to GRPO: scores are relative.

`mode="auto"` (the default) picks by the judge (`autorl.judge.is_local_judge`): a judge on this
machine (loopback URL, or a local LiteLLM runtime such as ollama) is usually a small model and
gets `LOCAL_MODE`, the mode measured best for SmolLM2-135M by bench/ruler_agreement.py; any
other judge gets "sampled". A local judge that gives no label probabilities (no logprobs from
its endpoint, or no label among its top tokens) falls back to "sampled" for that group, counted
in the group's `judge_fallbacks` metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from autorl.judge import JudgeConfig, is_local_judge

JudgingMode = Literal["auto", "sampled", "weighted", "pairwise"]
"""How the judge scores a group (module docstring)."""

YES_NO: tuple[str, ...] = ("No", "Yes")
"""The weighted mode's default scale: P("Yes") is the score."""

ONE_TO_FIVE: tuple[str, ...] = ("1", "2", "3", "4", "5")
"""A five-point digit scale for the weighted mode (G-Eval's)."""

LOCAL_MODE: JudgingMode = "weighted"
"""What `mode="auto"` uses for a local judge: the best mode of bench/ruler_agreement.py
(docs/benchmarks.md, "RULER judge agreement")."""


@dataclass(frozen=True)
class RulerConfig:
    """How RULER asks its judge (the judge itself is a `JudgeConfig`)."""

    mode: JudgingMode = "auto"
    """"sampled", "weighted", "pairwise", or "auto": `LOCAL_MODE` for a local judge, else
    "sampled" (module docstring)."""
    scale: tuple[str, ...] = YES_NO
    """Weighted mode: the labels the judge answers with, worst first, each one token (`YES_NO`,
    the default and the best measured for SmolLM2-135M, or e.g. `ONE_TO_FIVE`); the score is the
    expected label position under the judge's probabilities, 0 (first) .. 1 (last)."""
    top_logprobs: int = 20
    """Weighted and pairwise modes: alternatives asked for at the answer token (1..20; OpenAI
    and our server allow up to 20). More makes it likelier every label is seen."""
    max_concurrency: int = 8
    """Weighted and pairwise modes: judge calls of one group in flight at once."""

    def __post_init__(self) -> None:
        if self.mode not in get_args(JudgingMode):
            raise ValueError(f"RulerConfig.mode must be one of {get_args(JudgingMode)}, got {self.mode!r}")
        folded = [str(label).strip().lower() for label in self.scale]
        if not 2 <= len(folded) <= 10 or not all(folded) or len(set(folded)) != len(folded):
            raise ValueError(
                f"RulerConfig.scale must be 2..10 distinct non-empty labels (worst first, one token each, "
                f"e.g. ('No', 'Yes') or ('1', '2', '3', '4', '5')), got {self.scale!r}"
            )
        object.__setattr__(self, "scale", tuple(self.scale))
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"RulerConfig.top_logprobs must be 1..20, got {self.top_logprobs}")
        if self.max_concurrency < 1:
            raise ValueError(f"RulerConfig.max_concurrency must be >= 1, got {self.max_concurrency}")


def resolve_mode(config: RulerConfig, judge: JudgeConfig) -> JudgingMode:
    """The mode `config` means for `judge` ("auto" resolved; module docstring)."""
    if config.mode != "auto":
        return config.mode
    return LOCAL_MODE if is_local_judge(judge) else "sampled"


@dataclass(frozen=True)
class TrajectoryScore:
    """The judge's verdict on one trajectory."""

    trajectory_id: str
    """The trajectory's id in the prompt: "1" for the first message list, "2" for the second..."""
    score: float
    """Between 0 and 1; only its rank within the group matters to GRPO."""
    explanation: str
    """The judge's reason for the score (in the logprob modes: what the probabilities were)."""


@dataclass(frozen=True)
class Judgement:
    """Scores for every input trajectory, and how they were obtained."""

    scores: list[TrajectoryScore]
    """One per input message list, ids "1".."N" in input order."""
    attempts: int
    """Judge calls made; 0 when every answer came from the cache."""
    judged: int
    """Distinct trajectories the judge saw (identical ones are judged once)."""
    errors: int = 0
    """Calls that gave no usable answer (transport errors, invalid answers), retried or not."""
    mode: JudgingMode = "sampled"
    """The mode that produced the scores."""
    fallback: bool = False
    """True when "auto" fell back to "sampled" because the judge gave no label probabilities."""


__all__ = [
    "LOCAL_MODE",
    "ONE_TO_FIVE",
    "YES_NO",
    "JudgingMode",
    "Judgement",
    "RulerConfig",
    "TrajectoryScore",
    "resolve_mode",
]
