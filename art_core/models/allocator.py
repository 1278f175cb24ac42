"""The C allocator's hold on freed memory: giving it back, and bounding its per-thread arenas.

torch's CPU tensors come from the C library's `malloc`. With glibc, memory freed by a train step
(activations, a chunk's full-vocabulary logits) mostly stays in the process: a freed large block
raises glibc's dynamic mmap threshold, so later blocks of that size are carved from the heap, and
each thread that allocates (the engine's worker, the train step's worker thread, the server's)
gets its own arena of such free-but-kept memory. `art demo` measured ~1.3 GB of it at its peak
(docs/benchmarks.md, "Where `art demo`'s memory goes"). `limit_arenas` caps the arenas (call it
at process start, before threads allocate); `release_free_memory` returns the free pages of every
arena to the OS (`malloc_trim`), a few milliseconds after a train step.

Elsewhere than glibc both do nothing and say so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8
"""glibc's `mallopt` parameter for the most arenas (malloc.h)."""


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
    import os

    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))
