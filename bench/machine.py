"""Where a benchmark ran: the CPU model, its features, and the ISA that torch and oneDNN use.

Every benchmark prints `machine_header()` first, so a figure is never read without the CPU behind
it: the same code is 1.5x apart between an Intel CPU with AMX and an AMD EPYC without it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "avx_ne_convert")
"""The CPU flags that decide our kernels: AVX-512, native bf16 (AVX512-BF16, AMX), bf16 packing."""

_ONEDNN_PROBE = """
import torch
w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16), 1)
torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16), w, None, "none", [], "")
"""


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo has them (a
    virtual machine often names only the vendor's line, "AMD EPYC", for several generations:
    family 23 model 49 and family 25 model 1 differ in caches and speed)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name}, family {fields['cpu family']} model {fields['model']}"
    return name


def cpu_features() -> list[str]:
    """Which of `FEATURES` the CPU has (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    present = set(flags.split(":", 1)[-1].split())
    return [name for name in FEATURES if name in present]


def onednn_isa() -> str:
    """The ISA oneDNN dispatches to here, as its verbose mode reports it (one tiny matmul in a
    subprocess); "unknown" if it says nothing."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    try:
        out = subprocess.run(
            [sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True, text=True, timeout=120
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    found = re.search(r"cpu,isa:(.+)", out)
    return found.group(1).strip() if found else "unknown"


def machine_header() -> str:
    """One line: CPU model, core count, features, torch's ATen ISA, oneDNN's ISA, bf16 probes (and
    the measured bf16 speedup that the "auto" choices go by)."""
    import torch

    from art_core.models.hardware import (
        cpu_bf16_pays,
        cpu_bf16_speedup,
        cpu_has_native_bf16,
        onednn_packs_bf16,
    )

    caps = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    measured = cpu_bf16_speedup()  # the measurement `cpu_bf16_pays` decides by (None: not native)
    speedup = "" if measured is None else f"bf16 matmul {measured:.2f}x float32's, "
    return (
        f"cpu: {cpu_model()} ({os.cpu_count()} CPUs; {' '.join(cpu_features()) or 'no AVX2'}); "
        f"torch {torch.__version__} ISA {torch.backends.cpu.get_cpu_capability()}; "
        f"oneDNN ISA {onednn_isa()}; native bf16 {cpu_has_native_bf16()}, "
        f"bf16 packing {onednn_packs_bf16()}, {speedup}bf16 pays {cpu_bf16_pays()}"
        + (f"; caps {caps}" if caps else "")
    )


if __name__ == "__main__":
    print(machine_header())
