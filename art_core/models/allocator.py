"""The C allocator's hold on freed memory: giving it back, and bounding its per-thread arenas.

torch's CPU tensors come from the C library's `malloc`. With glibc, memory freed by a train step
(activations, a chunk's full-vocabulary logits) mostly stays in the process: a freed large block
raises glibc's dynamic mmap threshold, so later blocks of that size are carved from the heap, and
each thread that allocates (the engine's worker, the train step's worker thread, the server's)
gets its own arena of such free-but-kept memory. `art demo` measured ~1.3 GB of it at its peak
(docs/benchmarks.md, "Where `art demo`'s memory goes"). `limit_arenas` caps the arenas (call it
at process start, before threads allocate); `release_free_memory` returns the free pages of every
arena to the OS (`malloc_trim`). Giving pages back is not free: the next train step touches its
activations again and the kernel zero-fills every page (~0.4 s of a 2.5 s SmolLM2 step measured on
an AMD EPYC). `HeapTrimmer` therefore trims after a step only when the free-but-kept heap has
grown past what one step reuses, which bounds the memory without paying that on every step.

glibc also gives memory back on its own, at `free` time: the top of the heap once it exceeds the
trim threshold, and blocks over the mmap threshold (both dynamic, up to 64 and 32 MiB). With the
defaults `bench/profile_train_step.py`'s step (SmolLM2-135M-Instruct, 8 x 105 tokens, 2 threads,
AVX2 EPYC) faulted in 25,000-85,000 pages and spent 60-200 ms in the kernel every step, steps of
2.43-2.68 s; `keep_freed_memory` (the mmap threshold fixed at 32 MiB, the trim threshold at 1 GiB)
took that to ~200 faults and no system time, steps of 2.28-2.29 s, the same peak RSS (2.05 GB).
`HeapTrimmer`'s trims still bound the growth. It is a process-wide choice, so the library never
makes it on import: our entry points (the `art` CLI, the benchmarks' workers) call it, and never
over the user's own `MALLOC_*_` variables or `glibc.malloc` tunables.

Elsewhere than glibc these do nothing and say so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8
"""glibc's `mallopt` parameters (malloc.h): the most arenas, the trim and the mmap thresholds."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""`keep_freed_memory`: blocks of this size or more get their own mapping (glibc's dynamic maximum)."""
TRIM_THRESHOLD_BYTES = 2**30
"""`keep_freed_memory`: free memory at the top of the heap beyond this goes back to the OS at `free`."""
USER_MALLOC_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
"""glibc's environment variables for those settings: when the user set one, theirs win."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None  # not glibc (musl has neither)
    return libc


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def free_heap_bytes() -> int | None:
    """Bytes glibc's malloc keeps free in all its arenas (`mallinfo2`: fordblks + fsmblks); None
    where unknown (not glibc, or a glibc older than 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.fordblks + info.fsmblks)


DEFAULT_HEAP_SLACK_BYTES = 256 * 2**20
"""How far the free heap may grow past one step's working set before `HeapTrimmer` trims it."""


class HeapTrimmer:
    """Trims the C heap after a train step when its free memory has grown, not after every step.

    Right after a step, the heap's free memory is mostly the step's own activations, which the next
    step reuses; trimming them only makes the next step fault them in again. What must not happen
    is growth: freed blocks that the next steps do not reuse (other threads' arenas, fragmentation)
    piling up step after step (~70 MB a step in `art demo` without trimming). So: trim after the
    first step (what loading left behind), take the free heap after the next step as the working
    set, and trim again only when the free heap exceeds it by more than `slack_bytes` (then measure
    the working set anew). The resident memory thus stays within `slack_bytes` of trimming every
    step. Where the free heap cannot be read, it trims after every step.
    """

    def __init__(
        self,
        slack_bytes: int = DEFAULT_HEAP_SLACK_BYTES,
        *,
        read_free: Callable[[], int | None] = free_heap_bytes,
        trim: Callable[[], bool] | None = None,
    ) -> None:
        if slack_bytes < 0:
            raise ValueError(f"slack_bytes must be >= 0, got {slack_bytes}")
        self.slack_bytes = slack_bytes
        self._read_free = read_free
        self._trim = trim if trim is not None else release_free_memory
        self._working_set: int | None = None
        self._just_trimmed = False
        self.trims = 0
        """How many times `after_step` trimmed."""

    def after_step(self) -> bool:
        """Call after each train step; returns whether it trimmed now."""
        free = self._read_free()
        if free is None:
            return self._count(self._trim())
        if self._working_set is None and self._just_trimmed:
            self._working_set, self._just_trimmed = free, False
            return False
        if self._working_set is not None and free <= self._working_set + self.slack_bytes:
            return False
        self._working_set, self._just_trimmed = None, True
        return self._count(self._trim())

    def _count(self, trimmed: bool) -> bool:
        self.trims += int(trimmed)
        return trimmed


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim(0)`); False where unsupported."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def limit_arenas(count: int) -> bool:
    """Let glibc's malloc use at most `count` arenas (like `MALLOC_ARENA_MAX`); False where unsupported.

    Takes effect for arenas not yet created: call it before other threads allocate. The
    environment variable, when set, wins (the user chose).
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    libc = _libc()
    if libc is None:
        return False
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` and raise its trim threshold to
    `TRIM_THRESHOLD_BYTES` (see the module docstring): memory a train step frees stays for the next
    one. False, setting nothing, where unsupported or where the user set any of these
    (`USER_MALLOC_SETTINGS`, `glibc.malloc` tunables). Process-wide; any time (later frees follow it)."""
    libc = _libc()
    if libc is None:
        return False
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in environ for name in USER_MALLOC_SETTINGS) or "glibc.malloc." in tunables:
        return False
    mmap_set = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return mmap_set and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
