"""The internal precision of float32 matrix multiplies while training.

The trainer keeps its weights, activations, gradients and optimizer state in the model's dtype
(float32 on a CPU by default). What this module chooses is only how a float32 matmul is computed:

- "ieee": exact float32 products.
- "bf16": inputs rounded to bfloat16, products accumulated in float32 (oneDNN's fast-math mode on
  CPUs with native bf16 instructions, AVX512-BF16 or AMX). The CPU analogue of TF32; about 3x
  faster matmuls on such CPUs, at bf16 input rounding (log-probs move by ~0.01-0.04 nats).
- "tf32": TF32 tensor cores on CUDA GPUs (Ampere and newer).
- "auto": "bf16" on a CPU with native bf16, "tf32" on a CUDA GPU, "ieee" otherwise.

Mixed precision is what users of other trainers get by default: TRL's `GRPOConfig(bf16=True)` (its
default) runs the forward under bf16 autocast; GPUs train in bf16. `matmul_precision` scopes the
setting to a block and restores torch's previous global setting afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

MatmulPrecision = Literal["auto", "ieee", "bf16", "tf32"]
PRECISIONS: tuple[str, ...] = ("auto", "ieee", "bf16", "tf32")


BF16_NATIVE_ISA_CAPS = frozenset(
    {
        "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
        "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL",
    }
)  # fmt: skip
"""Values of oneDNN's ISA cap (`ONEDNN_MAX_CPU_ISA`) at which its bf16 kernels may run natively."""


def onednn_isa_cap() -> str | None:
    """oneDNN's ISA cap from the environment (`ONEDNN_MAX_CPU_ISA`, or its old name
    `DNNL_MAX_CPU_ISA`), upper-cased; None when unset (oneDNN then uses all the CPU has)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


def _cpu_feature(name: str) -> bool:
    """A CPU feature as torch's cpuinfo sees it (`torch.cpu._is_<name>_supported`); False where
    this torch has no such probe."""
    probe = getattr(torch.cpu, f"_is_{name}_supported", None)
    return bool(probe()) if probe is not None else False


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here: the CPU has AVX512-BF16 or AMX (its
    features, probed; never its vendor) and oneDNN's ISA cap, if one is set, allows them.

    Without them a bf16 matmul is emulated (converted to float32 and back), slower than float32.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    cap = onednn_isa_cap()
    allowed = cap is None or cap in BF16_NATIVE_ISA_CAPS
    return allowed and (_cpu_feature("avx512_bf16") or _cpu_feature("amx_tile"))


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN can hold a bf16 linear weight in its packed layout on this CPU.

    torch's `mkldnn._reorder_linear_weight` refuses bf16 on CPUs without AVX512BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only CPU, say): a tiny weight is packed and multiplied once, the
    answer kept.
    """
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    ):
        return False
    try:
        packed = ops._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
        ops._linear_pointwise(torch.zeros(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


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
    if device.type == "cpu" and cpu_has_native_bf16():
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
