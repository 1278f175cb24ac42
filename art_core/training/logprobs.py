"""Per-token log-probs (and entropy) from final hidden states, in memory-bounded chunks.

Naive equivalent: `torch.log_softmax(hidden @ W.T, -1).gather(-1, targets[..., None])[..., 0]`, which keeps the
full [B*T, V] logits alive for backward. Here the B*T positions are processed `chunk_size` at a time, so
full-vocabulary logits exist for one chunk at a time. log_softmax runs in float32 whatever the input dtype
(the projection itself runs in the weight's dtype, as in the model's own forward).

Two backward strategies:
- frozen head (a weight and bias that need no gradient, the LoRA case): the gradient of log p(t) with respect
  to the hidden state, W[t] - softmax(logits) @ W, is computed in forward, and only that [N, H] tensor is
  kept; backward scales it by the incoming gradient. Two head matmuls per position instead of three
  (forward, recomputed forward, backward). The vocabulary is walked in blocks of `VOCAB_BLOCK` rows of W
  with a running max and sum (an online softmax, as flash attention does over keys): each block's
  logits are made, exponentiated and multiplied by its rows of W while they are in cache, and no
  [N, V] tensor is ever made. On SmolLM2's head (512 positions, a 49,152-token vocabulary, float32,
  2 threads, AVX2) that took 361-373 ms against 466 ms for the whole-vocabulary logits, log_softmax
  and exp (which also held two 100 MB tensors).
- otherwise (a trainable head, any other module): each chunk runs under `torch.utils.checkpoint`
  (non-reentrant): forward stores the chunk's inputs, backward recomputes its logits.

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
    with torch.no_grad():  # log_softmax of finite logits is finite, so p * log p is 0 where p underflows
        entropy = -torch.linalg.vecdot(logp_all.exp(), logp_all)
    return picked, entropy


VOCAB_BLOCK = 4096
"""Rows of the head's weight per block of the frozen head's online softmax: a block's logits for
512 positions are 8 MB (in cache); 1,024-8,192 measured alike."""


def _frozen_head_chunk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    vocab_block: int,
    with_entropy: bool,
    need_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """For [N, H] `hidden` and [N] `targets` (>= 0): log p(target) [N], the entropy [N] if
    `with_entropy` and E_p[W] [N, H] (float32) if `need_grad`, walking the vocabulary in blocks.

    Running per row: m, the largest logit so far; s = sum exp(z - m); t = sum exp(z - m) (z - m);
    e = sum exp(z - m) W[z's token]. A block that raises m rescales them by exp(m_old - m).
    Then log Z = m + log s, the entropy is log s - t / s and E_p[W] = e / s.

    With a float32 head and E_p[W] wanted anyway, t is not accumulated (a product and a sum over
    every block's probabilities): the logits are linear in W, so E_p[z] = h . E_p[W] + E_p[b] and
    the entropy is log Z - E_p[z]. A bf16 head's E_p[W] rounds the probabilities to bf16, too
    coarse for that difference, so it keeps t.
    """
    h = hidden.to(weight.dtype)
    rows = h.shape[0]
    picked = torch.empty(rows, dtype=torch.float32, device=h.device)
    entropy_from_expected = with_entropy and need_grad and weight.dtype == torch.float32
    track_spread = with_entropy and not entropy_from_expected
    largest = sums = spread = expected = bias_sums = None
    for start in range(0, weight.shape[0], vocab_block):
        block = weight[start : start + vocab_block]
        logits = F.linear(h, block, None if bias is None else bias[start : start + vocab_block]).float()
        inside = (targets >= start) & (targets < start + block.shape[0])
        at_target = logits.gather(-1, (targets - start).clamp(0, block.shape[0] - 1)[:, None])[:, 0]
        picked = torch.where(inside, at_target, picked)
        block_max = logits.amax(dim=-1)
        grown = block_max if largest is None else torch.maximum(largest, block_max)
        shifted = logits.sub_(grown[:, None])  # z - m, in place: the logits are not needed again
        # exp(z - m), unnormalised; in place too unless the entropy still needs z - m
        probs = torch.exp(shifted) if track_spread else shifted.exp_()
        block_sum = probs.sum(dim=-1)
        block_spread = torch.linalg.vecdot(probs, shifted) if track_spread else None
        block_bias = None
        if entropy_from_expected and bias is not None:
            block_bias = probs @ bias[start : start + block.shape[0]].float()
        if largest is None:
            sums, spread, bias_sums = block_sum, block_spread, block_bias
            if need_grad:
                expected = _times(probs, block)
        else:
            assert sums is not None
            rescale = torch.exp(largest - grown)
            if track_spread:  # t_new = r (t + (m_old - m) s) + the block's
                assert spread is not None and block_spread is not None
                spread = rescale * (spread + (largest - grown) * sums) + block_spread
            if bias_sums is not None and block_bias is not None:
                bias_sums = bias_sums * rescale + block_bias
            sums = sums * rescale + block_sum
            if need_grad:
                assert expected is not None
                expected.mul_(rescale[:, None])
                if block.dtype == torch.float32:
                    expected.addmm_(probs, block)
                else:
                    expected.add_(_times(probs, block))
        largest = grown
        del logits, shifted, probs
    assert largest is not None and sums is not None
    log_sums = sums.log()
    logprobs = picked - largest - log_sums
    expected_w = None if expected is None else expected / sums[:, None]
    entropy = None
    if entropy_from_expected:  # log Z - E_p[z], E_p[z] = h . E_p[W] + E_p[b]
        assert expected_w is not None
        mean_logit = torch.linalg.vecdot(h.float(), expected_w)
        if bias_sums is not None:
            mean_logit = mean_logit + bias_sums / sums
        entropy = largest + log_sums - mean_logit
    elif with_entropy and spread is not None:
        entropy = log_sums - spread / sums
    return logprobs, entropy, expected_w


def _times(probs: Tensor, block: Tensor) -> Tensor:
    """[N, Vb] float32 weights times the [Vb, H] block of the head, in the head's dtype, as float32."""
    return (probs.to(block.dtype) @ block).float()


class _FrozenHeadLogprobs(torch.autograd.Function):
    """log p(target) of [N, H] hidden states under a frozen linear head; gradients flow to `hidden` only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_size: int,
        vocab_block: int,
        with_entropy: bool,
        need_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        picked, entropies, directions = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            valid = t >= 0
            safe_t = t.clamp(min=0)
            lp, entropy, expected = _frozen_head_chunk(
                h, weight, bias, safe_t, vocab_block, with_entropy, need_grad
            )
            picked.append(torch.where(valid, lp, torch.zeros((), dtype=lp.dtype, device=lp.device)))
            if entropy is not None:
                entropies.append(entropy)
            if expected is not None:  # d log p(t) / d h = W[t] - E_p[W]
                direction = weight[safe_t].float() - expected
                directions.append(direction * valid[:, None].to(direction.dtype))
        if need_grad:
            empty = hidden.new_zeros(0, hidden.shape[-1], dtype=torch.float32)
            ctx.save_for_backward(torch.cat(directions) if directions else empty)
        ctx.hidden_dtype = hidden.dtype  # type: ignore[attr-defined]
        logprobs = torch.cat(picked) if picked else hidden.new_zeros(0, dtype=torch.float32)
        entropy = torch.cat(entropies) if entropies else logprobs.new_zeros(())
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor, grad_entropy: Tensor
    ) -> tuple[Tensor | None, None, None, None, None, None, None, None]:
        (direction,) = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_hidden = (grad_logprobs.float()[:, None] * direction).to(ctx.hidden_dtype)  # type: ignore[attr-defined]
        return grad_hidden, None, None, None, None, None, None, None


def _frozen_linear(lm_head: torch.nn.Module | Tensor) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a head whose parameters need no gradient; None for any other head."""
    if isinstance(lm_head, Tensor):
        return None if lm_head.requires_grad else (lm_head, None)
    if type(lm_head) is torch.nn.Linear:
        bias = lm_head.bias
        if lm_head.weight.requires_grad or (bias is not None and bias.requires_grad):
            return None
        return lm_head.weight, bias
    return None


def token_logprobs(
    hidden: Tensor,
    lm_head: torch.nn.Module | Tensor,
    targets: Tensor,
    chunk_size: int = 512,
    with_entropy: bool = False,
    vocab_block: int = VOCAB_BLOCK,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) [B, T] in float32, and the per-position entropy [B, T] (detached) if `with_entropy`.

    hidden: [B, T, H] final (normed) hidden states. lm_head: an nn.Linear, a [V, H] weight, or any module
    mapping [N, H] to [N, V] logits. targets: [B, T] int64 next-token ids (the caller shifts; see
    `sequence_targets`); negative targets give log-prob 0. Gradients flow to hidden and to the head's
    parameters exactly as in the naive full log_softmax + gather. `vocab_block`: vocabulary rows per
    block of a frozen head's online softmax.
    """
    if hidden.dim() != 3 or tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"hidden must be [B, T, H] and targets [B, T]; got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size < 1 or vocab_block < 1:
        raise ValueError(f"chunk_size and vocab_block must be >= 1, got {chunk_size} and {vocab_block}")
    batch, length = targets.shape
    flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(torch.long)
    frozen = _frozen_linear(lm_head)
    if frozen is not None:
        weight, bias = frozen
        if flat_targets.numel() and int(flat_targets.max()) >= weight.shape[0]:
            raise ValueError(
                f"target id {int(flat_targets.max())} is outside the head's vocabulary of {weight.shape[0]}: "
                "the tokens do not belong to this model's tokenizer"
            )
        need_grad = torch.is_grad_enabled() and flat_hidden.requires_grad
        flat_logprobs, flat_entropy = _FrozenHeadLogprobs.apply(
            flat_hidden, weight, bias, flat_targets, chunk_size, vocab_block, with_entropy, need_grad
        )
        logprobs = flat_logprobs.reshape(batch, length)
        return logprobs, flat_entropy.reshape(batch, length).detach() if with_entropy else None
    project = _projection(lm_head)
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
