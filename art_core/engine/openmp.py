"""OpenMP's wait policy for the CPU engines: spin briefly at a barrier, then sleep.

A decode step is hundreds of small ops, each an OpenMP parallel region that ends at a barrier.
libgomp (torch's OpenMP on Linux) lets a thread that reaches a barrier spin before it sleeps:
300,000 times by default. On a machine the process has to itself, spinning saves a wake-up per
op; when other processes share the cores the spinning threads take the CPU the descheduled ones
need, and a step crawls. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`) fixes the shared case but
pays a wake-up per op on a quiet machine. A short spin keeps most of both: measured with
`bench/thread_policy.py` on a 2-core AMD EPYC (avx512_bf16), 32 rows, tok/s quiet / under a
50%-duty background process: default 524 / 254, PASSIVE 394 / 275, `GOMP_SPINCOUNT=10000` 492 /
290 (docs/benchmarks.md, "When the engine does not have the machine to itself").

The runtime reads these variables once, when torch loads it, so they must be set before
`import torch`: `prefer_short_spin` does that for our entry points (the `art` CLI, the
benchmarks' servers) and never overrides a policy or spin count the user set.

Whatever the spin count, libgomp cuts every barrier's spin to 100 iterations (about a microsecond)
once the threads it manages outnumber the CPUs, and every thread that ever ran a parallel torch
op keeps a pool of them: the thread that loaded the model, the executor thread that trained,
beside the engine's decode thread. On 2 CPUs one extra pool is enough: the decode thread's
workers then sleep and wake at every op (~415 futex waits per SmolLM2 step at 32 rows against
~5, measured 60 -> 88 ms a step). `release_thread_pool` ends the calling thread's pool (its next
parallel op starts a new one); the engine calls it on the thread that built it, on the one
that resumes it after training, and on its decode thread whenever that has nothing to run (paused
for training or idle: the demo's train step took ~15% longer beside a live decode pool).
Standard library only: importing this module loads no torch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
SPINS = 10_000
"""Spins at a barrier before a thread sleeps (libgomp's default: 300,000): the measured best of
1,000-100,000 both quiet and under load (the module docstring)."""


def prefer_short_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set GOMP_SPINCOUNT=SPINS unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set already or torch is
    loaded (too late then); returns whether it set it. `environ` is this process's environment
    (the torch check is about this process): a child's environment can take `SPINS` directly."""
    if POLICY in environ or SPIN_COUNT in environ or "torch" in sys.modules:
        return False
    environ[SPIN_COUNT] = str(SPINS)
    return True


def wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """The OpenMP wait policy this process runs with, as its environment says: "PASSIVE", "ACTIVE",
    "SPIN <count>" (a spin count and no policy) or "DEFAULT" (neither set: libgomp's long spin)."""
    if POLICY in environ:
        return environ[POLICY].upper()
    if SPIN_COUNT in environ:
        return f"SPIN {environ[SPIN_COUNT]}"
    return "DEFAULT"


OMP_PAUSE_SOFT = 1
"""`omp_pause_soft` of OpenMP 5.0's `omp_pause_resource_t`: stop the threads, keep nothing warm."""


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker threads (libgomp's `omp_pause_resource_all`), so that
    they no longer count against the CPUs and shorten other threads' barrier spins (the module
    docstring). Call it on a thread that has finished its torch work for now; its next parallel
    op starts new workers (~0.1 ms). Returns whether it ran: False where torch's OpenMP is not a
    libgomp this process has loaded (then nothing is throttled this way) or inside a parallel region."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def releasing_thread_pool(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, then `release_thread_pool` on the same thread (for torch work handed to a worker thread,
    e.g. with `asyncio.to_thread`, whose thread lives on in the executor)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            release_thread_pool()

    return wrapper


_LIBGOMP: list[ctypes.CDLL] = []


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (found in /proc/self/maps; None before torch loads it or off Linux)."""
    if _LIBGOMP:
        return _LIBGOMP[0]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "omp_pause_resource_all"):  # OpenMP 5.0 (GCC 9 and later)
            _LIBGOMP.append(lib)
            return lib
    return None
