"""Policy losses for GRPO-style training: pure tensor functions in a registry.

Every loss takes a `LossBatch` (per-token log-probs, mask, one advantage per sequence) and a `LossConfig`, and
returns a `LossOutput` whose `loss` is this micro-batch's share of the optimizer batch's loss: the
normalisers (`num_sequences`, `num_tokens`, `max_completion_tokens`) describe the WHOLE optimizer batch, so
summing the losses (and gradients) of its micro-batches gives exactly the loss of the batch in one piece.

Included:
- `grpo`: token-level PPO clip, mean over each sequence's tokens, mean over sequences (Shao et al. 2024).
- `dr_grpo`: the same clip, summed over tokens, divided by num_sequences * a constant length (Liu et al. 2025).
- `dapo`: clip-higher (epsilon_high 0.28), token-level mean over every token of the batch (Yu et al. 2025).
- `gspo`: sequence-level ratio exp(mean log-ratio), in GSPO's token form with a stop-gradient
  (Zheng et al. 2025); default clip range 3e-4 / 4e-4 as in the paper.
- `cispo`: clipped, detached importance weight times A * logp, token-level mean (MiniMax-M1 2025); default
  lower bound 0 (epsilon 1.0, i.e. none) and epsilon_high 4.0 as in OpenPipe ART.
- Optional k3 KL to a reference policy (the base model with the LoRA disabled), reduced like the loss.
- Optional truncated importance sampling (TIS) against the inference engine's log-probs:
  w = min(exp(old - engine), tis_cap), detached, 1 where the engine log-prob is unknown (NaN).

Left out: value functions / GAE, entropy bonuses, advantage whitening across groups (see `advantages.py`),
dual-clip PPO, ART's `kimi_k2_tau` / `mask_prob_ratio` / negative-advantage IS caps, KL folded into
advantages. Metrics other than `policy_loss`/`kl_loss` are means over this micro-batch's masked tokens
(weight them by `metrics["tokens"]` to combine micro-batches).

Masked positions contribute exactly nothing, even when their log-probs are garbage (NaN, -inf): inputs are
replaced by zeros there with `torch.where` before any arithmetic, so no NaN * 0 can appear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from art_core.training.config import LossConfig


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch of B sequences of T positions, plus normalisers of the whole optimizer batch."""

    logprobs: Tensor
    """[B, T] log-prob of each target token under the current policy (requires grad)."""
    old_logprobs: Tensor
    """[B, T] behaviour-policy log-probs, detached. On-policy training passes `logprobs.detach()`."""
    engine_logprobs: Tensor
    """[B, T] the inference engine's log-probs of the sampled tokens; NaN where unknown (TIS weight 1)."""
    advantages: Tensor
    """[B] one advantage per sequence."""
    mask: Tensor
    """[B, T] 1 on trained (sampled) tokens, 0 elsewhere (prompt, padding, tool results). Bool or float."""
    num_sequences: float
    """Sequences in the WHOLE optimizer batch (all micro-batches), for exact gradient accumulation."""
    num_tokens: float
    """Masked (trained) tokens in the WHOLE optimizer batch."""
    max_completion_tokens: float
    """Constant length normaliser for dr_grpo, e.g. the longest masked length in the whole batch."""
    ref_logprobs: Tensor | None = None
    """[B, T] reference (LoRA disabled) log-probs; needed iff kl_coef > 0."""

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {shape}")
        named = {
            "old_logprobs": self.old_logprobs,
            "engine_logprobs": self.engine_logprobs,
            "mask": self.mask,
        }
        if self.ref_logprobs is not None:
            named["ref_logprobs"] = self.ref_logprobs
        for label, tensor in named.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{label} must have the shape of logprobs {shape}, got {tuple(tensor.shape)}"
                )
        if tuple(self.advantages.shape) != shape[:1]:
            raise ValueError(f"advantages must be [B] = {shape[:1]}, got {tuple(self.advantages.shape)}")
        for label, value in (
            ("num_sequences", self.num_sequences),
            ("num_tokens", self.num_tokens),
            ("max_completion_tokens", self.max_completion_tokens),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{label} must be > 0 (count it over the whole optimizer batch), got {value}"
                )


@dataclass(frozen=True)
class LossOutput:
    """A micro-batch's loss (summable across micro-batches) and detached scalar metrics."""

    loss: Tensor
    """Scalar to call `.backward()` on; summing micro-batch losses gives the whole batch's loss."""
    metrics: dict[str, Tensor]
    """Detached scalars: policy_loss, kl_loss and kl (if kl_coef > 0), clip_fraction, ratio_mean,
    tis_weight_mean (if TIS), tokens."""


LossFn = Callable[[LossBatch, LossConfig], LossOutput]


@dataclass(frozen=True)
class _Prepared:
    """Inputs made safe: float32+ dtype, zeros at masked positions, TIS weights computed."""

    logprobs: Tensor
    log_ratio: Tensor  # logprobs - old_logprobs, 0 where masked
    advantages: Tensor  # [B, 1]
    mask: Tensor  # bool [B, T]
    tis_weight: Tensor  # [B, T], detached, 1 where masked or unknown


def _prepare(batch: LossBatch, config: LossConfig) -> _Prepared:
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    mask = batch.mask.to(torch.bool)

    def safe(x: Tensor) -> Tensor:
        return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

    logprobs = safe(batch.logprobs)
    old = safe(batch.old_logprobs).detach()
    weight = torch.ones_like(old)
    if config.tis_cap is not None:
        engine = batch.engine_logprobs.to(dtype).detach()
        known = mask & ~torch.isnan(engine)
        raw = torch.exp(old - torch.where(known, engine, old)).clamp(max=config.tis_cap)
        weight = torch.where(known, raw, weight)
    return _Prepared(logprobs, logprobs - old, batch.advantages.to(dtype).detach()[:, None], mask, weight)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over positions where mask is true; masked-out values (even NaN) are ignored."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean_per_sequence(x: Tensor, mask: Tensor) -> Tensor:
    """[B]: mean of x over each row's masked positions; 0 for a row without any."""
    summed = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=-1)
    return summed / mask.sum(dim=-1).clamp(min=1).to(x.dtype)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(x, mask) / mask.sum().clamp(min=1).to(x.dtype)


Reduce = Callable[[Tensor, Tensor, LossBatch], Tensor]


def reduce_sequence_mean(x: Tensor, mask: Tensor, batch: LossBatch) -> Tensor:
    """Original GRPO: mean over each sequence's tokens, summed over sequences / num_sequences."""
    return masked_mean_per_sequence(x, mask).sum() / batch.num_sequences


def reduce_constant_length(x: Tensor, mask: Tensor, batch: LossBatch) -> Tensor:
    """Dr. GRPO: sum over tokens / (num_sequences * max_completion_tokens)."""
    return masked_sum(x, mask) / (batch.num_sequences * batch.max_completion_tokens)


def reduce_token_mean(x: Tensor, mask: Tensor, batch: LossBatch) -> Tensor:
    """DAPO / CISPO: sum over all tokens of the batch / num_tokens."""
    return masked_sum(x, mask) / batch.num_tokens


def _ppo_clip(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Per-token -min(r*A, clip(r)*A) and a bool tensor of where clipping removed the gradient."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    was_clipped = clipped.detach() < unclipped.detach()
    return -torch.minimum(unclipped, clipped), was_clipped


def _finish(
    prep: _Prepared,
    batch: LossBatch,
    config: LossConfig,
    policy: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    reduce: Reduce,
) -> LossOutput:
    """Weight by TIS, reduce, add KL, collect metrics."""
    mask = prep.mask
    policy_loss = reduce(policy * prep.tis_weight, mask, batch)
    metrics = {
        "policy_loss": policy_loss.detach(),
        "clip_fraction": _masked_mean(clipped.to(policy.dtype), mask).detach(),
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        "tokens": mask.sum().to(policy.dtype),
    }
    if config.tis_cap is not None:
        metrics["tis_weight_mean"] = _masked_mean(prep.tis_weight, mask)
    loss = policy_loss
    if config.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs LossBatch.ref_logprobs (log-probs with the LoRA disabled)")
        ref = torch.where(mask, batch.ref_logprobs.to(prep.logprobs.dtype), prep.logprobs).detach()
        delta = ref - prep.logprobs
        k3 = torch.exp(delta) - delta - 1.0
        kl_loss = config.kl_coef * reduce(k3, mask, batch)
        loss = loss + kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl"] = _masked_mean(k3.detach(), mask)
    return LossOutput(loss=loss, metrics=metrics)


def _clipped_ratio_loss(batch: LossBatch, config: LossConfig, reduce: Reduce) -> LossOutput:
    prep = _prepare(batch, config)
    low, high = config.clip_range()
    ratio = torch.exp(prep.log_ratio)
    policy, clipped = _ppo_clip(ratio, prep.advantages, low, high)
    return _finish(prep, batch, config, policy, ratio, clipped, reduce)


def grpo_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Token-level PPO clip, mean per sequence, mean over sequences."""
    return _clipped_ratio_loss(batch, config, reduce_sequence_mean)


def dr_grpo_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Token-level PPO clip, summed, / (num_sequences * max_completion_tokens)."""
    return _clipped_ratio_loss(batch, config, reduce_constant_length)


def dapo_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Token-level PPO clip with clip-higher, / num_tokens."""
    return _clipped_ratio_loss(batch, config, reduce_token_mean)


def gspo_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Sequence-level ratio s = exp(mean log-ratio), GSPO-token form s_t = sg[s] * exp(lp - sg[lp])."""
    prep = _prepare(batch, config)
    low, high = config.clip_range()
    seq_log_ratio = masked_mean_per_sequence(prep.log_ratio.detach(), prep.mask)[:, None]
    ratio = torch.exp(seq_log_ratio + prep.logprobs - prep.logprobs.detach())
    policy, clipped = _ppo_clip(ratio, prep.advantages, low, high)
    return _finish(prep, batch, config, policy, ratio, clipped, reduce_sequence_mean)


def cispo_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """-clip(r.detach(), 1 - eps, 1 + eps_high) * A * logp, / num_tokens."""
    prep = _prepare(batch, config)
    low, high = config.clip_range()
    ratio = torch.exp(prep.log_ratio.detach())
    is_weight = ratio.clamp(1.0 - low, 1.0 + high)
    policy = -is_weight * prep.advantages * prep.logprobs
    return _finish(prep, batch, config, policy, ratio, is_weight != ratio, reduce_token_mean)


LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def compute_loss(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Dispatch to `LOSSES[config.name]`."""
    try:
        fn = LOSSES[config.name]
    except KeyError:
        raise ValueError(f"unknown loss name {config.name!r}; choose one of {sorted(LOSSES)}") from None
    return fn(batch, config)
