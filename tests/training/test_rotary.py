"""The trainer's rotary embedding (`training.rotary`) against transformers' formula, values and gradients."""

from __future__ import annotations

import torch

from art_core.models.llama_ops import rotate as reference
from art_core.models.llama_ops import rotate_signed, swap_halves
from art_core.training.rotary import rotate, signed_sin
from tests.tolerances import rounding_tolerance


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens, heads, dim = 7, 3, 8
    x = torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=generator, dtype=torch.float64) * 6
    angles = torch.cat([angles, angles], dim=-1)  # transformers' layout: the halves share their angles
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def test_values_and_input_gradient_equal_transformers_rotation() -> None:
    x, cos, sin = _inputs(torch.float32)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = rotate(ours_x, cos, signed_sin(sin)), reference(theirs_x, cos, sin)
    tolerance = rounding_tolerance(torch.float32, length=2, scale=float(x.abs().max()))
    assert (ours - theirs).abs().max() <= tolerance
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    ours.backward(grad)
    theirs.backward(grad)
    assert ours_x.grad is not None and theirs_x.grad is not None
    assert (ours_x.grad - theirs_x.grad).abs().max() <= rounding_tolerance(
        torch.float32, length=2, scale=float(grad.abs().max())
    )
    # a sine whose sign was not folded in gives other values: the test can tell
    assert (rotate(x, cos, sin) - theirs).abs().max() > 100 * tolerance
    with torch.no_grad():  # the path without autograd computes the same
        assert torch.equal(rotate(x, cos, signed_sin(sin)), ours.detach())


def test_backward_is_the_jacobian_transpose_in_float64() -> None:
    x, cos, sin = _inputs(torch.float64)
    signed = signed_sin(sin)
    assert torch.autograd.gradcheck(lambda t: rotate(t, cos, signed), (x.clone().requires_grad_(),))


def test_decode_steps_signed_rotation_equals_transformers_bit_for_bit() -> None:
    """`llama_ops.rotate_signed` (the decode step's) rounds as transformers' formula does, in every dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        x, cos, sin = _inputs(dtype)
        assert torch.equal(rotate_signed(x, cos, signed_sin(sin)), reference(x, cos, sin))
        assert torch.equal(swap_halves(swap_halves(x)), x)
