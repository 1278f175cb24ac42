"""OpenMP's wait policy for the CPU engines: sleep at a barrier instead of spinning.

libgomp (torch's OpenMP on Linux) lets a thread that reaches a barrier spin for a while before
it sleeps. On a machine the process has to itself that saves a wake-up per op; when other
processes share the cores the spinning threads take the CPU the descheduled ones need, and a
decode step of hundreds of small ops crawls (measured on a shared 2-core EPYC: 2.1 tok/s with
libgomp's default against 13.5 with `OMP_WAIT_POLICY=PASSIVE` and 11.8 with one thread;
docs/benchmarks.md, "When the engine does not have the machine to itself"). The runtime reads the
policy from the environment once, when torch loads it, so it must be set before `import torch`:
`prefer_passive_wait` does that for our entry points (the `art` CLI, the benchmarks' servers)
and never overrides a policy the user set. Standard library only: importing it loads no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

POLICY = "OMP_WAIT_POLICY"


def prefer_passive_wait(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless it is set already or torch is loaded (too late then);
    returns whether it set it."""
    if POLICY in environ or "torch" in sys.modules:
        return False
    environ[POLICY] = "PASSIVE"
    return True


def wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """The OpenMP wait policy this process runs with, as its environment says ("default" if unset)."""
    return environ.get(POLICY, "default").upper()
