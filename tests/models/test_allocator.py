"""glibc heap settings (`models.allocator.keep_freed_memory`): what they change, and that users' own win."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from art_core.models.allocator import keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# What a train step does to the heap: many blocks of a few MB allocated, written, all freed, again.
# Prints the page faults of the second round.
ROUNDS = """
import ctypes, resource, sys
from art_core.models.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, count = 2 << 20, 100
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in reversed(blocks):
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_memory_is_reused_without_faulting_it_back_in() -> None:
    pages = 100 * (2 << 20) // 4096  # what the second round touches
    assert _second_round_faults("default") > pages // 2  # glibc returned it and faults it in again
    assert _second_round_faults("keep") < pages // 20


def test_a_users_own_malloc_settings_win() -> None:
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
