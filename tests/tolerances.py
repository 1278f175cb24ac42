"""Float tolerances for comparing two computations of one value: derived, never guessed.

Two correct computations of the same float expression differ by rounding alone, and by how much
depends on the machine: torch and oneDNN pick their kernels by the CPU's features (AVX2, AVX-512,
AMX; blocked, packed or not) and each sums in its own order, with or without fused multiply-adds.
A tolerance tuned on one CPU can then fail on another. So every tolerance here is computed from
what bounds the error:

- the unit roundoff u of the dtype (half its machine epsilon: 2**-24 in float32, 2**-8 in bf16)
  and of the dtype sums accumulate in (float32 for bf16: its output rounding dominates);
- the reduction length n: a sum of n terms computed in any order is off by at most about n*u
  times the sum of the terms' magnitudes (Higham, "Accuracy and Stability of Numerical
  Algorithms", section 4.2), and by about sqrt(n)*u times it when the rounding errors are
  independent with mean zero (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019), which is the
  case for the reordering between kernels. We use the sqrt(n) form;
- the magnitude `scale` of the terms (not of the result, which may cancel): for a whole tensor
  the largest magnitude it holds;
- the depth: errors of chained reductions (the layers of a model, the backward after the
  forward) add up, at worst linearly;
- a safety factor for the tail: the largest of many errors is several times their spread
  (about 4.5 sigma over 1e5 values), and two computations can each be off in opposite ways.

A real bug (a wrong mask, a scale applied twice, a stale weight) moves values by far more than
these bounds, so the tests still fail where they should.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SAFETY = 8.0
"""Tail factor: the max over many elements (~4.5 sigma) times two computations off oppositely."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of `dtype`: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def rounding_tolerance(
    dtype: torch.dtype,
    *,
    length: int,
    scale: float = 1.0,
    depth: int = 1,
    accumulate: torch.dtype | None = None,
) -> float:
    """The largest difference expected between two correct computations of values made by `depth`
    chained operations, each summing up to `length` terms at most `scale` in magnitude and
    rounding its result to `dtype` (see the module docstring for why).

    `accumulate` is the dtype the sums run in: float32 for narrower dtypes (bf16 and fp16
    matmuls accumulate in float32 on CPUs and GPUs alike), else `dtype` itself. Each operation
    then errs by one rounding of its output plus sqrt(length) roundings of its accumulator.
    """
    if length < 1 or depth < 1 or not scale >= 0:
        raise ValueError(f"length and depth must be >= 1 and scale >= 0, got {length}, {depth}, {scale}")
    if accumulate is None:
        accumulate = torch.float32 if torch.finfo(dtype).bits < 32 else dtype
    per_operation = unit_roundoff(dtype) + math.sqrt(length) * unit_roundoff(accumulate)
    return SAFETY * per_operation * depth * scale


def model_shape(model: Any) -> tuple[int, int]:
    """(reduction length, depth) of a transformers causal LM's forward: its longest matmul
    reduction (hidden, MLP or head size) and its layers plus the head."""
    config = model.config
    length = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    return length, config.num_hidden_layers + 1


def model_tolerance(model: Any, dtype: torch.dtype, *, scale: float, backward: bool = False) -> float:
    """`rounding_tolerance` for values computed by `model`'s forward (and its backward, which
    doubles the chain) in `dtype`, of magnitude `scale`."""
    length, depth = model_shape(model)
    return rounding_tolerance(dtype, length=length, scale=scale, depth=depth * (2 if backward else 1))


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, length: int, depth: int = 1
) -> None:
    """`actual` equals `expected` up to rounding: every element within `rounding_tolerance` of
    the tensor's own scale (the largest magnitude `expected` holds)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    atol = rounding_tolerance(dtype, length=length, scale=scale, depth=depth)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def assert_close_to_model(
    actual: torch.Tensor, expected: torch.Tensor, model: Any, dtype: torch.dtype, *, backward: bool = False
) -> None:
    """`assert_close` with the reduction length and depth of `model`'s forward (and backward)."""
    length, depth = model_shape(model)
    assert_close(actual, expected, dtype=dtype, length=length, depth=depth * (2 if backward else 1))
