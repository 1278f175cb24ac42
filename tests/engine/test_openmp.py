"""The OpenMP spin count is set for our entry points only when the user did not choose a wait policy."""

from __future__ import annotations

import os
import subprocess
import sys

from art_core.engine.openmp import SPINS, prefer_short_spin, wait_policy


def test_sets_nothing_when_torch_is_loaded_or_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert not prefer_short_spin(env)  # torch is loaded in the test process: too late to matter
    assert env == {} and wait_policy(env) == "DEFAULT"
    user = {"OMP_WAIT_POLICY": "passive"}
    assert not prefer_short_spin(user) and user == {"OMP_WAIT_POLICY": "passive"}
    assert wait_policy(user) == "PASSIVE"
    spins = {"GOMP_SPINCOUNT": "500"}
    assert not prefer_short_spin(spins) and wait_policy(spins) == "SPIN 500"


def test_a_fresh_process_gets_the_short_spin_before_torch_loads() -> None:
    code = (
        "import os, sys\n"
        "from art_core.engine.openmp import prefer_short_spin, wait_policy\n"
        "assert 'torch' not in sys.modules\n"
        "print(prefer_short_spin(), os.environ['GOMP_SPINCOUNT'], wait_policy().replace(' ', '_'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(SPINS), f"SPIN_{SPINS}"]


def test_release_thread_pool_ends_the_calling_threads_openmp_workers() -> None:
    code = (
        "import time, torch\n"
        "from art_core.engine.openmp import release_thread_pool\n"
        "def threads():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('Threads')).split()[1])\n"
        "torch.set_num_threads(3)\n"
        "before = threads()\n"
        "a = torch.randn(256, 256)\n"
        "(a @ a).sum()  # a parallel region: the main thread's pool gets 2 workers\n"
        "with_pool = threads()\n"
        "released = release_thread_pool()\n"
        "deadline = time.monotonic() + 5  # the workers exit right after they are let go\n"
        "while threads() > with_pool - 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "after = threads()\n"
        "(a @ a).sum()  # a new pool on demand\n"
        "print(released, with_pool - before, with_pool - after, threads() - after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, started, ended, restarted = out.stdout.split()
    assert released == "True"
    assert int(started) == 2 and int(ended) == 2 and int(restarted) == 2


def test_the_engine_worker_lets_its_openmp_workers_go_when_it_has_nothing_to_run() -> None:
    """Idle or paused (one check: nothing it may run), the decode thread's pool would cut the
    trainer's barrier spins (every pool's workers count against the CPUs); the worker ends it, and
    its next op starts a new one."""
    code = (
        "import time, torch\n"
        "from art_core.engine.torch.engine import TorchEngine\n"
        "from art_core.models.loading import load_model\n"
        "def threads():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('Threads')).split()[1])\n"
        "def steady():  # the count once it stops changing (released workers exit shortly after)\n"
        "    previous, deadline = -1, time.monotonic() + 5\n"
        "    while (count := threads()) != previous and time.monotonic() < deadline:\n"
        "        previous = count\n"
        "        time.sleep(0.05)\n"
        "    return count\n"
        "def work():  # on the worker: a parallel region starts its pool of 2\n"
        "    a = torch.randn(256, 256)\n"
        "    (a @ a).sum()\n"
        "    return threads()\n"
        "torch.set_num_threads(3)\n"
        "loaded = load_model('tiny-random')\n"
        "engine = TorchEngine(loaded.model, loaded.tokenizer)\n"
        "base = steady()\n"
        "during = engine._control(work)\n"
        "idle = steady()\n"
        "again = engine._control(work)\n"
        "print(during - base, idle - base, again - base, steady() - base)\n"
        "engine.close()\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [int(n) for n in out.stdout.split()] == [2, 0, 2, 0]
