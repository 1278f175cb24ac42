"""Sampling parameters and the per-step token sampler.

`sample_next` turns one step of logits into token ids for a whole batch, with a temperature,
a top-p and an optional seeded `torch.Generator` per row. Every row draws exactly one uniform
number per step from its own generator and picks its token by inverse CDF, so a seeded row
samples the same tokens whatever else shares its batch (and whichever position it has in it).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Seed for reproducible sampling, in [-2**63, 2**64) (what a torch generator takes); None draws
    from torch's global generator."""
    top_logprobs: int = 0
    """How many most likely alternatives (id, logprob) to return per position; 0 = none."""
    ignore_eos: bool = False
    """Do not end on the model's end-of-turn/eos ids (the engine's own ones): a completion then runs
    to max_tokens unless `stop` or `stop_token_ids` end it (vLLM's option; benchmarks use it)."""

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
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")


def row_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (index 0 uses `seed` itself)."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) % (2**63)


def draw_uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from the row's generator, or torch's global one."""
    out = torch.rand(len(generators))
    for i, generator in enumerate(generators):
        if generator is not None:
            out[i] = torch.rand((), generator=generator)
    return out


def top_p_filter(sorted_probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities (sorted descending per row) that fall outside each row's nucleus.

    A token is kept when the mass of the tokens ranked above it is below top_p, so the most
    likely token is always kept.
    """
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_above < top_ps[:, None]
    keep[:, 0] = True
    return sorted_probs * keep


NUCLEUS_CANDIDATES: tuple[int, ...] = (64, 1024)
"""Top-k sizes tried before a full sort: a row whose top-k mass reaches its top_p has its whole
nucleus inside its top k. Sorting a 49k vocabulary costs ~8 ms a row on this CPU, top-64 ~0.25 ms."""


def sample_nucleus(probs: torch.Tensor, top_ps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling restricted to each row's top-p nucleus; the token ids [B].

    Each row takes the smallest candidate set (top 64, top 1024, else all tokens sorted) that
    covers its nucleus; the choice depends on the row alone, never on the rest of the batch.
    """
    out = torch.empty(probs.shape[0], dtype=torch.long)
    todo = torch.arange(probs.shape[0])
    for k in (*NUCLEUS_CANDIDATES, probs.shape[-1]):
        full = k >= probs.shape[-1]
        if full:
            values, ids = probs[todo].sort(dim=-1, descending=True)
        else:
            values, ids = probs[todo].topk(k, dim=-1)
        covered = torch.ones_like(todo, dtype=torch.bool) if full else values.sum(-1) >= top_ps[todo]
        rows = todo[covered]
        kept = top_p_filter(values[covered], top_ps[rows])
        out[rows] = ids[covered].gather(1, inverse_cdf(kept, uniforms[rows])[:, None])[:, 0]
        todo = todo[~covered]
        if len(todo) == 0:
            break
    return out


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first column where the cumulative (unnormalised) probability exceeds u * total.

    Rows of `CDF_BLOCK` * 4 columns or more (a vocabulary) go by blocks: the cumulative sum of the
    block sums picks the block, then that block's own cumulative sum picks the column. That is
    the column one cumulative sum over the whole row picks, up to float rounding, for a fraction
    of the work (32 x 49k: one summing pass and 32 short cumsums instead of a 1.8 ms cumsum). A
    column of probability 0 is never picked (in a row with any mass), rounding included.
    """
    rows, width = probs.shape
    targets = uniforms[:, None].to(probs.dtype)
    if width < 4 * CDF_BLOCK:
        cdf = probs.cumsum(dim=-1)
        return _first_above(probs, cdf, targets * cdf[:, -1:])[:, 0]
    whole = width // CDF_BLOCK * CDF_BLOCK
    sums = probs[:, :whole].reshape(rows, -1, CDF_BLOCK).sum(dim=-1)
    if whole < width:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block_cdf = sums.cumsum(dim=-1)
    targets = targets * block_cdf[:, -1:]
    block = _first_above(sums, block_cdf, targets)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK)
    inside = columns < width  # the last block may be short
    values = probs.gather(1, columns.clamp(max=width - 1)) * inside
    picked = _first_above(values, values.cumsum(dim=-1), targets - before)
    return (block * CDF_BLOCK + picked)[:, 0]


CDF_BLOCK = 256
"""Columns per block of `inverse_cdf`'s two-level search."""


def _first_above(probs: torch.Tensor, cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, 1] index of the first `cdf` entry above `targets` [B, 1]; where rounding put a target at
    or above the row's total, the row's last column of non-zero probability instead."""
    found = torch.searchsorted(cdf, targets, right=True)
    past = found >= cdf.shape[-1]
    if bool(past.any()):
        columns = torch.arange(cdf.shape[-1]).expand_as(cdf)
        last = torch.where(probs > 0, columns, 0).amax(dim=-1, keepdim=True)
        found = torch.where(past, last, found)
    return found


def chosen_logprobs(logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[row, ids[row]] from `probs` = softmax(logits) [B, V]; `ids` is [B] or
    [B, k] (k tokens per row), and the result has its shape.

    The log of the picked probability (exact to ~1e-7 for probabilities above `EXACT_BELOW`); entries
    whose picked probability is smaller (a token a grammar forced against the model, say) take the
    exact logit minus log-sum-exp instead, so no logprob ever reads -inf from an underflowed 0.
    """
    columns = ids[:, None] if ids.dim() == 1 else ids
    picked = probs.gather(1, columns)
    out = picked.log()
    tiny = (picked < EXACT_BELOW).nonzero()
    if len(tiny):
        rows, cols = tiny[:, 0], tiny[:, 1]
        exact = logits[rows].float()
        out[rows, cols] = exact.gather(1, columns[rows, cols][:, None])[:, 0] - exact.logsumexp(dim=-1)
    return out[:, 0] if ids.dim() == 1 else out


def top_logprobs(
    logits: torch.Tensor, probs: torch.Tensor, sampled: torch.Tensor, sampled_logprobs: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each row and their logprobs, both [B, k], most likely first.

    The logprobs come from `chosen_logprobs`, the formula of the sampled token's own logprob, and
    a row's sampled token, when it is among its top k, reads `sampled_logprobs` itself: a token
    reported twice (as the choice and as an alternative) has one value, by construction, not two
    roundings of one number (vectorised and scalar `log` differ in the last bit on some CPUs).
    """
    ids = logits.topk(k, dim=-1).indices
    values = chosen_logprobs(logits, probs, ids)
    values = torch.where(ids == sampled[:, None], sampled_logprobs[:, None].to(values.dtype), values)
    return values, ids


EXACT_BELOW = 1e-30
"""`chosen_logprobs` recomputes a logprob whose probability is below this from the logits."""


TINY_TEMPERATURE = 1e-20
"""Below this temperature a row's logits are shifted by their max before dividing by it."""


def sample_next(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token id per row of `logits` [B, V]; returns a LongTensor [B].

    Rows with temperature 0 take the argmax. Other rows sample from softmax(logits / T),
    restricted to their top-p nucleus, by inverse CDF on one uniform number drawn from the
    row's generator (None: torch's global generator). Every row draws its number, greedy or
    not, so a row's random stream depends only on its own generator. `probs`, the caller's
    `softmax(logits)` if it has it, saves a second softmax when every sampled row is at
    temperature 1.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if not (len(temperatures) == len(top_ps) == len(generators) == logits.shape[0]):
        raise ValueError("temperatures, top_ps and generators need one entry per row of logits")
    logits = logits.float()
    uniforms = draw_uniforms(generators)
    greedy = temperatures <= 0
    out = torch.zeros(logits.shape[0], dtype=torch.long)
    if bool(greedy.any()):
        out[greedy] = logits[greedy].argmax(dim=-1)
    sampling = (~greedy).nonzero()[:, 0]
    if len(sampling) == 0:
        return out
    everyone = len(sampling) == logits.shape[0]
    rows = logits if everyone else logits[sampling]
    temps = temperatures.float() if everyone else temperatures[sampling].float()
    if probs is not None and bool((temps == 1).all()):
        return _sample_rows(out, probs if everyone else probs[sampling], sampling, top_ps, uniforms)
    tiny = temps < TINY_TEMPERATURE
    if bool(tiny.any()):
        # logits / T overflows to inf (softmax: NaN) for T ~ 1e-40: shift those rows by their max
        # first. Only for them: exp of the shifted logits makes denormals, 5x slower on this CPU.
        rows = rows.clone()
        rows[tiny] -= rows[tiny].amax(dim=-1, keepdim=True)
    probs = torch.softmax(rows / temps[:, None], dim=-1)
    return _sample_rows(out, probs, sampling, top_ps, uniforms)


def _sample_rows(
    out: torch.Tensor,
    probs: torch.Tensor,
    sampling: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Fill `out`'s `sampling` rows with draws from `probs` (one row each), top-p where asked."""
    picked = inverse_cdf(probs, uniforms[sampling])
    nucleus = (top_ps[sampling] < 1).nonzero()[:, 0]
    if len(nucleus):
        picked[nucleus] = sample_nucleus(
            probs[nucleus], top_ps[sampling][nucleus].float(), uniforms[sampling][nucleus]
        )
    out[sampling] = picked
    return out


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
