"""Bounded oneDNN primitive caches for the CPU engines: a serving process whose memory stays flat.

torch's CPU matmuls in bf16 (and its packed mkldnn linears) go through oneDNN, which keeps the
primitives it creates in two caches: oneDNN's own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's,
the one torch's mkldnn ops use (`LRU_CACHE_CAPACITY`). Both are keyed by shape and hold up to 1,024
entries by default. Serving makes a new shape at almost every step (the batch's row count, each
prefill's length), and an entry is not small (~0.7 MB for one of SmolLM2's bf16 projections,
measured), so with the defaults `art serve`'s RSS grew by ~270 MB per 10,000 requests and had
not levelled off at 10,000; with both caches off it stays flat, but every op re-creates its
primitive: one-at-a-time decode of SmolLM2-135M ran 3x slower (16 -> 4.9 tok/s). At 64 entries
each, decode speed is unchanged and the caches stop growing once full (docs/reliability.md,
"The fix: rows that left take their columns with them").

Both runtimes read their capacity from the environment once, when torch loads them, so it must be
set before `import torch`: `bound_primitive_caches` does that for our entry points (the `art`
CLI, the benchmarks' servers) and never overrides a capacity the user set. Standard library only:
importing it loads no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache and ideep's (torch's mkldnn ops), in that order."""

SERVING_CAPACITY = 64
"""Entries per cache for our processes: enough for a decode step's few weight shapes at several
batch sizes, small enough that a full cache costs tens of MB, not gigabytes."""


def bound_primitive_caches(
    environ: MutableMapping[str, str] = os.environ, capacity: int = SERVING_CAPACITY
) -> list[str]:
    """Set each cache's capacity to `capacity` unless the user set it or torch is loaded (too late
    then); returns the variables it set."""
    if capacity < 0:
        raise ValueError(f"a primitive cache capacity is >= 0, got {capacity}")
    if "torch" in sys.modules:
        return []
    chosen = [name for name in CAPACITY_VARIABLES if name not in environ]
    for name in chosen:
        environ[name] = str(capacity)
    return chosen
