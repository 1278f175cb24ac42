"""The OpenMP wait policy is set for our entry points only when the user did not set one."""

from __future__ import annotations

import os
import subprocess
import sys

from art_core.engine.openmp import prefer_passive_wait, wait_policy


def test_sets_passive_unless_set_or_torch_already_loaded() -> None:
    env: dict[str, str] = {}
    assert not prefer_passive_wait(env)  # torch is loaded in the test process: too late to matter
    assert env == {} and wait_policy(env) == "DEFAULT"
    user = {"OMP_WAIT_POLICY": "active"}
    assert not prefer_passive_wait(user) and wait_policy(user) == "ACTIVE"


def test_a_fresh_process_gets_passive_before_torch_loads() -> None:
    code = (
        "import os, sys\n"
        "from art_core.engine.openmp import prefer_passive_wait\n"
        "assert 'torch' not in sys.modules\n"
        "print(prefer_passive_wait(), os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "PASSIVE"]
