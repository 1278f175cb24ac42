"""The internal precision of float32 matrix multiplies while training.

The trainer keeps its weights, activations, gradients and optimizer state in the model's dtype
(float32 on a CPU by default). What this module chooses is only how a float32 matmul is computed:

- "ieee": exact float32 products.
- "bf16": inputs rounded to bfloat16, products accumulated in float32, on CPUs with native bf16
  instructions (AVX512-BF16 or AMX). The CPU analogue of TF32. The trainer computes its frozen base
  projections (almost all of a step's FLOPs) on bf16 copies of their weights (`training.bf16_base`),
  their outputs rounded to bf16 as under autocast; every other float32 matmul runs in oneDNN's
  fast-math mode, which rounds to bf16 with AMX but computes exact float32 on AVX512-BF16 CPUs
  without it (torch 2.13). Log-probs move by ~0.01-0.04 nats.
- "tf32": TF32 tensor cores on CUDA GPUs (Ampere and newer).
- "auto": "bf16" on a CPU where it pays (native bf16, and a bf16 matmul measured faster than a
  float32 one: `hardware.cpu_bf16_pays`), "tf32" on a CUDA GPU, "ieee" otherwise.

Mixed precision is what users of other trainers get by default: TRL's `GRPOConfig(bf16=True)` (its
default) runs the forward under bf16 autocast; GPUs train in bf16. `matmul_precision` scopes the
setting to a block and restores torch's previous global setting afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from art_core.models.hardware import cpu_bf16_pays, cpu_has_native_bf16
from art_core.training.config import PRECISIONS, MatmulPrecision


def resolve_precision(precision: MatmulPrecision, device: torch.device) -> str:
    """The concrete precision ("ieee", "bf16" or "tf32") that `precision` means on `device`."""
    if precision not in PRECISIONS:
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
            raise ValueError(
                "matmul_precision='bf16' needs a CPU with native bf16 (AVX512-BF16 or AMX); "
                "this one has none: use 'auto' or 'ieee'"
            )
        return precision
    if device.type == "cuda":
        return "tf32"
    if device.type == "cpu" and cpu_bf16_pays():
        return "bf16"
    return "ieee"


@contextlib.contextmanager
def matmul_precision(precision: MatmulPrecision, device: torch.device) -> Iterator[str]:
    """Run the block with float32 matmuls on `device` at `precision`; yields the concrete one."""
    concrete = resolve_precision(precision, device)
    backend: Any
    if device.type == "cuda":
        backend = torch.backends.cuda.matmul
        value = "tf32" if concrete == "tf32" else "ieee"
    elif device.type == "cpu":
        backend = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # set in torch's __init__
        value = "bf16" if concrete == "bf16" else "ieee"
    else:
        yield concrete
        return
    previous = backend.fp32_precision
    backend.fp32_precision = value
    try:
        yield concrete
    finally:
        backend.fp32_precision = previous
