"""The rotary embedding as one autograd node: the trainer's queries and keys for Llama-family models.

transformers' `apply_rotary_pos_emb` is `x * cos + rotate_half(x) * sin` with `rotate_half(x) =
cat(-x2, x1)`: five tensor ops forward, and autograd runs ~9 backward (two products, the negation,
the split of the concatenation, a zero-filled gradient and a copy for each of the two slices, the
sums of the three branches), each a pass over the [N, heads, head_dim] activations. A LoRA step on
SmolLM2 runs 60 of them (queries and keys of 30 layers): ~70 ms a step on a 2-core AVX2 CPU.

With the sign of `rotate_half` folded into the sine once per step (`signed_sin`: [-sin1, sin2]),
the rotation is `x * cos + swap(x) * signed_sin`, `swap` exchanging the halves of the last
dimension. `swap` is its own transpose, so the input gradient is `g * cos + swap(g * signed_sin)`:
three passes each way (`rotate`). `signed_sin` and the swap (`swap_halves`) live in
`models.llama_ops`, which the decode step's rotation (`rotate_signed`) uses too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from art_core.models.llama_ops import signed_sin, swap_halves

__all__ = ["rotate", "signed_sin"]


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return (x * cos).addcmul_(swap_halves(x), sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return swap_halves(grad * sin).addcmul_(grad, cos), None, None


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding `llama_ops.rotate(x, cos, plain_sin)` of x [..., heads, head_dim], given
    cos and `sin = signed_sin(plain_sin)` [..., 1, head_dim] (which need no gradient); one autograd
    node when `x` needs a gradient."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(x, cos, sin)  # type: ignore[no-any-return]
    return (x * cos).addcmul_(swap_halves(x), sin)
