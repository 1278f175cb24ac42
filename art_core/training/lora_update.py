"""The LoRA update `out += scaling * down @ B^T`, added in place, with a backward laid out for BLAS.

Every plain LoRA layer the trainer runs computes its base output, then adds the low-rank update
to it in place (no copy of the [N, out] output). Written as `out.addmm_(down, B.t())`, autograd's
backward of that `addmm_` multiplies the [N, out] gradient by narrow rank-r operands in the
layouts it happens to hold them in: the gradient of B as `grad^T @ down` ([out, N] x [N, r]) and
the gradient of `down` as `grad @ B` with B row-major ([N, out] x [out, r]). MKL runs both on its
slow path for a narrow right operand: SmolLM2's gate/up (N = 545, out = 1536, r = 8, 2 threads,
AVX2) took 802 and 618 us, where `(down^T @ grad)^T` and `grad @ B` with B column-major take 217
and 251 us for the same products. A LoRA step makes 210 such updates; their backward was ~7% of
the step on that CPU (docs/benchmarks.md, "Train step").

`add_lora_update_` is that `addmm_` with the faster backward; values and gradients are the same
products, summed in another order (tests/training/test_lora_update.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _LoraUpdate(torch.autograd.Function):
    """`out += scaling * down @ up^T` in place; gradients for `out` (passed through), `down` and `up`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, out: Tensor, down: Tensor, up: Tensor, scaling: float
    ) -> Tensor:
        ctx.mark_dirty(out)
        ctx.save_for_backward(down, up)
        ctx.scaling = scaling
        return out.addmm_(down, up.t(), alpha=scaling)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor, Tensor | None, Tensor | None, None]:
        down, up = ctx.saved_tensors
        scaling: float = ctx.scaling
        grad_down = lora_down_grad(grad, up, scaling) if ctx.needs_input_grad[1] else None
        grad_up = lora_up_grad(grad, down, scaling) if ctx.needs_input_grad[2] else None
        return grad, grad_down, grad_up, None


def lora_down_grad(grad: Tensor, up: Tensor, scaling: float) -> Tensor:
    """The gradient of `down` [N, r] in `out += scaling * down @ up^T`, for the output's gradient
    `grad` [N, out]: [N, out] x [out, r] with the narrow operand column-major."""
    return torch.mm(grad, up.t().contiguous().t()).mul_(scaling)


def lora_up_grad(grad: Tensor, down: Tensor, scaling: float) -> Tensor:
    """The gradient of the LoRA B weight `up` [out, r] in `out += scaling * down @ up^T`:
    ([r, N] x [N, out])^T rather than [out, N] x [N, r]."""
    return torch.mm(down.t(), grad).t().mul_(scaling)


def add_lora_update_(out: Tensor, down: Tensor, up: Tensor, scaling: float) -> Tensor:
    """`out.addmm_(down, up.t(), alpha=scaling)` for [N, out] `out`, [N, r] `down` and the [out, r]
    LoRA B weight `up`, returning `out`; with the backward described in the module docstring when
    any of them needs a gradient."""
    if torch.is_grad_enabled() and (out.requires_grad or down.requires_grad or up.requires_grad):
        return _LoraUpdate.apply(out, down, up, scaling)  # type: ignore[no-any-return]
    return out.addmm_(down, up.t(), alpha=scaling)
