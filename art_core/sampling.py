"""Sampling parameters and the per-step token sampler.

`sample_next` turns one step of logits into token ids for a whole batch, with a temperature,
a top-p and an optional seeded `torch.Generator` per row. Every row draws exactly one uniform
number per step from its own generator and picks its token by inverse CDF, so a seeded row
samples the same tokens whatever else shares its batch (and whichever position it has in it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs`; we keep the same one."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions."""

    n: int = 1
    """How many completions to sample for the prompt (they run in the same batch)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    max_tokens: int = 256
    """Most tokens to sample per completion; the engine also caps it to the context window."""
    stop: tuple[str, ...] = ()
    """Stop strings: a completion ends as soon as its text contains one; the text excludes it."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (kept in `token_ids`, removed from the text)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from torch's global generator."""
    top_logprobs: int = 0
    """How many most likely alternatives (id, logprob) to return per position; 0 = none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (the number of completions), got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")


def row_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (index 0 uses `seed` itself)."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) % (2**63)


def draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from the row's generator, or torch's global one."""
    out = torch.rand(len(generators))
    for i, generator in enumerate(generators):
        if generator is not None:
            out[i] = torch.rand((), generator=generator)
    return out


def top_p_filter(probs: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row's probabilities and zero those outside its nucleus.

    Returns (sorted probabilities with the tail zeroed, the token id at each sorted position).
    A token is kept when the mass of the tokens ranked above it is below top_p, so the most
    likely token is always kept.
    """
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_above < top_ps[:, None]
    keep[:, 0] = True
    return sorted_probs * keep, sorted_ids


def sample_next(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token id per row of `logits` [B, V]; returns a LongTensor [B].

    Rows with temperature 0 take the argmax. Other rows sample from softmax(logits / T),
    restricted to their top-p nucleus, by inverse CDF on one uniform number drawn from the
    row's generator (None: torch's global generator). Every row draws its number, greedy or
    not, so a row's random stream depends only on its own generator.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not (len(temperatures) == len(top_ps) == len(generators) == batch):
        raise ValueError("temperatures, top_ps and generators need one entry per row of logits")
    logits = logits.float()
    uniforms = draw_uniforms(generators)
    greedy = temperatures <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures).float()
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    if bool((top_ps < 1).any()):
        probs, ids = top_p_filter(probs, top_ps.float())
    else:
        ids = None
    cdf = probs.cumsum(dim=-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    positions = torch.searchsorted(cdf, targets, right=True).clamp_(max=logits.shape[-1] - 1)
    sampled = positions.squeeze(1) if ids is None else ids.gather(1, positions).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def stop_window_tokens(stops: tuple[str, ...]) -> int:
    """How many trailing tokens surely cover a stop string that ends at the newest token.

    A character is at most 4 UTF-8 bytes and a token at least one byte, so a stop string of
    s characters spans at most 4*s tokens, plus one token that may straddle its start.
    """
    return 4 * max((len(s) for s in stops), default=0) + 1


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest stop string starts, or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
