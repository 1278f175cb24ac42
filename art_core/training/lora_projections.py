"""Linear projections of one input, each with a LoRA update, as one autograd node.

A transformer layer reads each normalised input through several LoRA layers: q/k/v read the same
[N, in] rows, gate/up read the same rows, o and down one each. `packed_forward.project` runs their
down-projections as one matmul and adds each update in place (`lora_update.add_lora_update_`).
Autograd then records a node per piece (the down-projection, a slice of it per layer, each base
matmul, each update) and, in backward, makes the input's gradient as one tensor per branch and adds
them up: with q/k/v, four [N, in] products (three base, one low-rank) and three additions, and a
zero-filled [N, r_total] tensor per slice of the down-projection's gradient.

`lora_projections` computes the same forward (`out_i = x W_i^T + b_i + s_i (x A^T)_i B_i^T`, the
base matmul first and the update added in place) and, in backward, accumulates the input's gradient
in one buffer: `grad_x = g_1 W_1`, then `grad_x += g_i W_i` and `grad_x += grad_down A` as
matmuls that add into it (BLAS's beta = 1: the sum is made while each product's tile is in cache,
not as a pass of its own). The LoRA B and down gradients are `lora_update`'s (the layouts it
measured: down^T g transposed, B column-major). SmolLM2-135M's train step on a 2-core AVX2 CPU: see
docs/benchmarks.md, "the LoRA projections as one autograd node".

Only for frozen base weights in the input's dtype (plain `nn.Linear` layers; the bf16 base copies of
`bf16_base` take the per-layer path). Values are the same products; gradients the same products
summed in another order (tests/training/test_lora_projections.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from art_core.training.lora_update import lora_down_grad, lora_up_grad
from art_core.training.rms_norm import norm_backward, norm_forward


def _project(
    x: Tensor,
    stacked_a: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    scalings: Sequence[float],
    ups: Sequence[Tensor],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The down-projection `x A^T` and each output, its update added in place on the base matmul's."""
    down = F.linear(x, stacked_a)
    outputs, start = [], 0
    for weight, bias, up, scaling in zip(weights, biases, ups, scalings, strict=True):
        rank = up.shape[1]
        out = F.linear(x, weight, bias)
        outputs.append(out.addmm_(down[:, start : start + rank], up.t(), alpha=scaling))
        start += rank
    return down, tuple(outputs)


class _LoraProjections(torch.autograd.Function):
    """Outputs `x' W_i^T + b_i + s_i down_i B_i^T` with `down = x' A^T` split by the B's ranks, where
    `x'` is `x` or, with a norm weight, `rms_norm.norm_forward(x, weight, eps)`; gradients for `x`,
    the stacked A and each B (the base weights, biases and the norm's weight are frozen)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        stacked_a: Tensor,
        weights: Sequence[Tensor],
        biases: Sequence[Tensor | None],
        scalings: Sequence[float],
        norm: tuple[Tensor, float] | None,
        *ups: Tensor,
    ) -> tuple[Tensor, ...]:
        normed, scale = norm_forward(x, *norm) if norm is not None else (x, None)
        down, outputs = _project(normed, stacked_a, weights, biases, scalings, ups)
        # With a norm, its input and [N, 1] scale are kept, not the normed [N, in] values.
        ctx.save_for_backward(x, stacked_a, down, scale, *ups)
        ctx.weights, ctx.scalings, ctx.norm = tuple(weights), tuple(scalings), norm
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, stacked_a, down, scale, *ups = ctx.saved_tensors
        weights: tuple[Tensor, ...] = ctx.weights
        scalings: tuple[float, ...] = ctx.scalings
        norm: tuple[Tensor, float] | None = ctx.norm
        need_x, need_a = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_ups = ctx.needs_input_grad[6:]
        grad_ups: list[Tensor | None] = []
        grad_downs: list[Tensor] = []
        start = 0
        for grad, up, scaling, need_up in zip(grads, ups, scalings, need_ups, strict=True):
            rank = up.shape[1]
            grad_ups.append(lora_up_grad(grad, down[:, start : start + rank], scaling) if need_up else None)
            if need_x or need_a:
                grad_downs.append(lora_down_grad(grad, up, scaling))
            start += rank
        grad_x = grad_a = None
        if need_x or need_a:
            # The same ops as the forward's: the same values, bit for bit.
            normed = norm_forward(x, *norm)[0] if norm is not None else x
            grad_down = torch.cat(grad_downs, dim=1) if len(grad_downs) > 1 else grad_downs[0]
            if need_a:
                grad_a = torch.mm(grad_down.t(), normed)
            if need_x:  # each product added into one buffer, the narrow low-rank one last
                grad_x = torch.mm(grads[0], weights[0])
                for grad, weight in zip(grads[1:], weights[1:], strict=True):
                    grad_x.addmm_(grad, weight)
                grad_x.addmm_(grad_down, stacked_a)
                if norm is not None:
                    grad_x = norm_backward(grad_x, x, norm[0], scale)
        return (grad_x, grad_a, None, None, None, None, *grad_ups)


def lora_projections(
    x: Tensor,
    stacked_a: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    ups: Sequence[Tensor],
    scalings: Sequence[float],
    norm: tuple[Tensor, float] | None = None,
) -> list[Tensor]:
    """`[x W_i^T + b_i + s_i (x A_i^T) B_i^T for each i]` for [N, in] `x`, the LoRA A weights stacked
    as [sum of ranks, in] `stacked_a` (in the order of the rest), frozen [out_i, in] base `weights`
    and `biases`, [out_i, r_i] LoRA B weights `ups` and scalings `s_i`, all in `x`'s dtype.

    `norm`: (frozen weight, epsilon) of a plain RMSNorm (`rms_norm.frozen_plain_norm`) that `x`
    goes through first; then backward keeps `x` and the norm's [N, 1] scale rather than the normed
    [N, in] values (the norm is recomputed: one pass over [N, in]), and `x`'s gradient is the norm's.
    """
    if any(weight.requires_grad for weight in weights) or any(
        bias is not None and bias.requires_grad for bias in biases
    ):
        raise ValueError("lora_projections computes no gradient for the base weights: they must be frozen")
    if norm is not None and norm[0].requires_grad:
        raise ValueError("lora_projections computes no gradient for the norm's weight: it must be frozen")
    if sum(up.shape[1] for up in ups) != stacked_a.shape[0]:
        raise ValueError(
            f"the B ranks {[up.shape[1] for up in ups]} do not add up to A's {stacked_a.shape[0]} rows"
        )
    if torch.is_grad_enabled() and (
        x.requires_grad or stacked_a.requires_grad or any(u.requires_grad for u in ups)
    ):
        return list(_LoraProjections.apply(x, stacked_a, weights, biases, scalings, norm, *ups))
    normed = norm_forward(x, *norm)[0] if norm is not None else x
    return list(_project(normed, stacked_a, weights, biases, scalings, ups)[1])
