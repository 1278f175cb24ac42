"""Per-token log-probs (and entropy) from final hidden states, in memory-bounded chunks.

Naive equivalent: `torch.log_softmax(hidden @ W.T, -1).gather(-1, targets[..., None])[..., 0]`, which keeps the
full [B*T, V] logits alive for backward. Here the B*T positions are processed `chunk_size` at a time, each
chunk under `torch.utils.checkpoint` (non-reentrant), so forward stores only the chunk's inputs and backward
recomputes one chunk's logits at a time. log_softmax runs in float32 whatever the input dtype (the
projection itself runs in the weight's dtype, as in the model's own forward).

Left out: tensor-parallel vocabularies, fused (Triton/Liger) kernels, logit soft-capping and temperature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Target id meaning "no next token here" (e.g. the last position); its log-prob is reported as 0."""


def sequence_targets(input_ids: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token targets for [B, T] ids: targets[:, t] = input_ids[:, t + 1]; the last column is ignore_index."""
    targets = torch.full_like(input_ids, ignore_index)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def _projection(lm_head: torch.nn.Module | Tensor) -> Callable[[Tensor], Tensor]:
    if isinstance(lm_head, Tensor):
        weight = lm_head
        return lambda h: F.linear(h.to(weight.dtype), weight)
    if isinstance(lm_head, torch.nn.Linear):
        linear = lm_head
        return lambda h: F.linear(h.to(linear.weight.dtype), linear.weight, linear.bias)
    return lm_head  # any module mapping [N, H] -> [N, V] (e.g. a LoRA-wrapped head)


def _chunk_logprobs(
    project: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    logits = project(hidden).float()
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = targets >= 0
    picked = logp_all.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    picked = torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    if not with_entropy:
        return picked, picked.new_zeros(())
    with torch.no_grad():
        probs = logp_all.exp()
        entropy = -torch.where(probs > 0, probs * logp_all, torch.zeros_like(probs)).sum(dim=-1)
    return picked, entropy


def token_logprobs(
    hidden: Tensor,
    lm_head: torch.nn.Module | Tensor,
    targets: Tensor,
    chunk_size: int = 512,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) [B, T] in float32, and the per-position entropy [B, T] (detached) if `with_entropy`.

    hidden: [B, T, H] final (normed) hidden states. lm_head: an nn.Linear, a [V, H] weight, or any module
    mapping [N, H] to [N, V] logits. targets: [B, T] int64 next-token ids (the caller shifts; see
    `sequence_targets`); negative targets give log-prob 0. Gradients flow to hidden and to the head's
    parameters exactly as in the naive full log_softmax + gather.
    """
    if hidden.dim() != 3 or tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"hidden must be [B, T, H] and targets [B, T]; got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length = targets.shape
    project = _projection(lm_head)
    flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(torch.long)
    use_checkpoint = torch.is_grad_enabled()
    picked: list[Tensor] = []
    entropies: list[Tensor] = []
    for start in range(0, batch * length, chunk_size):
        h, t = flat_hidden[start : start + chunk_size], flat_targets[start : start + chunk_size]
        if use_checkpoint:
            lp, ent = checkpoint(_chunk_logprobs, project, h, t, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(project, h, t, with_entropy)
        picked.append(lp)
        entropies.append(ent)
    logprobs = (
        torch.cat(picked).reshape(batch, length) if picked else flat_hidden.new_zeros(batch, length).float()
    )
    if not with_entropy:
        return logprobs, None
    entropy = torch.cat(entropies).reshape(batch, length) if entropies else torch.zeros_like(logprobs)
    return logprobs, entropy.detach()
