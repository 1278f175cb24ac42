"""Hardware probes: what this machine's CPU and kernel libraries can do, asked of its features.

Choices that pay on one CPU and not another (a bf16 serving copy, oneDNN-packed weights, bf16
training matmuls) are made by these probes: the CPU's features as torch's cpuinfo reports them,
and the ISA cap oneDNN is run under, never the CPU's vendor or model name. Each answer is cached
for the process. Shared by the engine (serving dtype, packing) and the trainer (matmul precision).
"""

from __future__ import annotations

import functools
import os

import torch

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
