"""RMSNorm with a frozen weight, as one autograd node: the trainer's norms for Llama-family models.

transformers' `LlamaRMSNorm` (and Qwen2's, Qwen3's and Mistral's, the same code) runs ~6 tensor
ops forward, so autograd records ~6 nodes and runs their backward one by one, each a pass over
the [N, H] activations. In LoRA training the norm's weight is frozen, and the gradient with
respect to the input has a closed form:

    n = x * r,  r = 1 / sqrt(mean(x^2) + eps),  y = w * n
    dL/dx = r * (g*w - n * mean(g*w * n))

`_FrozenRMSNorm` computes the same forward (in float32, the normalised values cast back to the
input's dtype before the weight multiplies them, as transformers does) and that backward, as
`r * g*w - x * (r^3 * mean(g*w * x))`, in four passes over [N, H] (a product, a dot product per
row, a scaling and a fused multiply-add). SmolLM2's [545, 576] norm took 0.67 against 2.2-3.3 ms
forward and backward (2 threads, AVX2), and a step runs 61 of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from art_core.models.llama_ops import PLAIN_RMS_NORMS


def norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(`w * n`, `r` [N, 1] in float32): the frozen norm's output and its inverse RMS."""
    x32 = x.float()
    scale = torch.rsqrt(torch.linalg.vecdot(x32, x32).div_(x.shape[-1]).add_(eps)).unsqueeze(-1)
    return weight * (x32 * scale).to(x.dtype), scale


def norm_backward(grad: Tensor, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """dL/dx for the output's gradient `grad`, the input `x` and `norm_forward`'s `scale`."""
    weighted = (grad * weight).float()
    x32 = x.float()
    # r * (g*w - n * mean(g*w * n)) with n = x * r: r * g*w - x * r^3 * mean(g*w * x)
    coefficient = torch.linalg.vecdot(weighted, x32).div_(x.shape[-1]).unsqueeze(-1).mul_(scale.pow(3))
    return weighted.mul_(scale).addcmul_(x32, coefficient, value=-1).to(x.dtype)


class _FrozenRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        out, scale = norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        x, weight, scale = ctx.saved_tensors
        return norm_backward(grad, x, weight, scale), None, None


def frozen_plain_norm(norm: nn.Module) -> tuple[Tensor, float] | None:
    """(weight, epsilon) of `norm` when it is one of `PLAIN_RMS_NORMS` with a frozen weight and no
    hooks, so that `norm_forward` computes what it does; None otherwise."""
    module: Any = norm
    if (
        type(norm).__name__ not in PLAIN_RMS_NORMS
        or module.weight.requires_grad
        or norm._forward_hooks
        or norm._forward_pre_hooks
    ):
        return None
    return module.weight, float(module.variance_epsilon)


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """`norm(x)`; through `_FrozenRMSNorm` when `norm` is one of `PLAIN_RMS_NORMS` with a frozen
    weight and gradients are being recorded (else the module itself, hooks included)."""
    plain = frozen_plain_norm(norm)
    if plain is None or not torch.is_grad_enabled() or not x.requires_grad:
        return norm(x)  # type: ignore[no-any-return]
    return _FrozenRMSNorm.apply(x, *plain)  # type: ignore[no-any-return]
