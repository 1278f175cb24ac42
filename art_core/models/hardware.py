"""Hardware probes: what this machine's CPU and kernel libraries can do, asked of its features
and, where features do not settle it, measured.

Choices that pay on one CPU and not another (a bf16 serving copy, oneDNN-packed weights, bf16
training matmuls) are made by these probes: the CPU's features as torch's cpuinfo reports them,
the ISA cap oneDNN is run under, and for bf16 a timed matmul, never the CPU's vendor or model
name. Native bf16 instructions do not make bf16 the faster choice everywhere: with AMX a bf16
matmul ran 4.4x float32's rate and on an AMD EPYC with AVX512-BF16 2.4x, but on an Intel Xeon with
AVX512-BF16 and no AMX it ran at half float32's rate (docs/benchmarks.md). Each answer is cached
for the process. Shared by the engine (serving dtype, packing) and the trainer (matmul precision).
"""

from __future__ import annotations

import functools
import os
import time

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


BF16_SPEEDUP_NEEDED = 1.25
"""How much faster than float32 a bf16 matmul must measure (`bf16_matmul_speedup`) for the "auto"
choices to take bf16. Measured ratios so far: 0.5 (Intel AVX512-BF16, no AMX), 2.4 (AMD EPYC
AVX512-BF16), 4.4 (Intel AMX); 1.25 leaves either side a wide margin for a noisy measurement."""

BF16_PROBE_SHAPE = (512, 576, 1536)
"""(rows, in, out) of the probe's matmul: a projection of SmolLM2-135M in a train step (~0.9 GFLOP;
3-6 ms a call on 2 cores without AMX). Large enough that the first calls' thread wake-ups do not
decide it: at 32 or 256 rows, a process's first measurement came out up to 2x off."""


def bf16_matmul_speedup(shape: tuple[int, int, int] = BF16_PROBE_SHAPE, repeats: int = 5) -> float:
    """float32's time over bf16's for one `F.linear` of `shape` (rows, in, out) on this CPU, at
    torch's current thread count: the best of `repeats` calls each, taken in turns so that a burst
    of other work slows both sides alike. Above 1, bf16 is faster. Not cached; see `cpu_bf16_pays`."""
    rows, fan_in, fan_out = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, fan_in, generator=generator)
    w = torch.randn(fan_out, fan_in, generator=generator)
    sides = {torch.float32: (x, w), torch.bfloat16: (x.to(torch.bfloat16), w.to(torch.bfloat16))}
    best = dict.fromkeys(sides, float("inf"))
    with torch.inference_mode():
        for _ in range(2):  # warm-up: oneDNN builds its kernels on first use; threads wake up
            for a, b in sides.values():
                torch.nn.functional.linear(a, b)
        for _ in range(repeats):
            for dtype, (a, b) in sides.items():
                started = time.perf_counter()
                torch.nn.functional.linear(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


@functools.cache
def cpu_bf16_speedup() -> float | None:
    """`bf16_matmul_speedup()` on this CPU, measured once a process (~0.17 s on 2 cores without
    AMX); None where bf16 is not native (`cpu_has_native_bf16`): nothing is timed there, since an
    emulated bf16 matmul of the probe's shape can take seconds."""
    return bf16_matmul_speedup() if cpu_has_native_bf16() else None


def cpu_bf16_pays() -> bool:
    """Whether the "auto" choices compute in bf16 on this CPU (a bf16 serving copy, bf16 training
    matmuls): it has native bf16 and a bf16 matmul measures at least `BF16_SPEEDUP_NEEDED` times
    float32's rate (`cpu_bf16_speedup`). Otherwise float32, which such a CPU then packs for
    decoding as it does without native bf16."""
    speedup = cpu_bf16_speedup()
    return speedup is not None and speedup >= BF16_SPEEDUP_NEEDED
