"""glibc's heap for our processes: memory a train step frees is kept for the next one, not
returned to the kernel and faulted back in.

A LoRA train step allocates and frees its activations and gradients, tensors of 1-6 MB each
for SmolLM2 and a few hundred MB in all, every step. glibc (the C library torch's CPU allocator
calls) returns free memory at the top of its heap to the kernel once it exceeds the trim
threshold, and serves blocks over the mmap threshold with their own mappings; both thresholds
move with the program's history (dynamic up to 32 MiB and 64 MiB). Whatever it gives back, the
next step faults in again, page by page. Measured on `bench/profile_train_step.py`'s step
(SmolLM2-135M-Instruct, 8 x 105 tokens, 2 threads, AVX2 EPYC): 25,000-85,000 page faults and
60-200 ms of system time a step at glibc's defaults, steps of 2.43-2.68 s; with the settings below
~200 faults, no system time, steps of 2.28-2.29 s. Peak RSS was the same, 2.05 GB both ways.

`keep_freed_memory` fixes the mmap threshold at glibc's own dynamic maximum (blocks under 32 MiB
come from the heap, as they do anyway once glibc has adapted) and raises the trim threshold to
1 GiB. The cost: memory freed after a peak stays in the process (its RSS does not fall back) until
it is reused or 1 GiB of it sits at the top of the heap; the peak itself does not grow. It is a
process-wide choice, so the library never makes it on import: our entry points (the `art` CLI,
the benchmarks' workers) call it, and never over a setting the user made (`MALLOC_*_` variables
or `glibc.malloc` tunables). Standard library only: importing this module loads no torch.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
"""glibc's `mallopt` parameter numbers (malloc.h)."""
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks of this size or more get their own mapping: glibc's dynamic maximum on 64-bit."""
TRIM_THRESHOLD = 1024 * 1024 * 1024
"""Free memory at the top of the heap beyond this is returned to the kernel."""

USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's environment variables for the same settings: the user's choice wins."""


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's mmap and trim thresholds as the module docstring says; False (nothing set)
    where the C library is not glibc or the user set them."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
