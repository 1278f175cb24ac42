"""oneDNN's primitive caches are bounded for our entry points, before torch loads, unless the user set them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from art_core.engine.onednn import (
    CAPACITY_VARIABLES,
    SERVING_CAPACITY,
    bound_primitive_caches,
    primitive_cache_capacities,
)


def _env_without_capacities() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}


def test_too_late_once_torch_is_loaded_and_a_negative_capacity_is_refused() -> None:
    env: dict[str, str] = {}
    assert bound_primitive_caches(env) == []  # the test process has torch loaded: it already read them
    assert env == {} and set(primitive_cache_capacities(env).values()) == {"default"}
    with pytest.raises(ValueError, match=">= 0"):
        bound_primitive_caches(env, capacity=-1)


def test_a_fresh_process_bounds_both_caches_but_keeps_what_the_user_set() -> None:
    code = (
        "import json, os, sys\n"
        "from art_core.engine.onednn import bound_primitive_caches, primitive_cache_capacities\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps([bound_primitive_caches(), primitive_cache_capacities()]))\n"
    )
    fresh = subprocess.run(
        [sys.executable, "-c", code],
        env=_env_without_capacities(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.strip() == (
        f'[["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"], '
        f'{{"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "{SERVING_CAPACITY}", "LRU_CACHE_CAPACITY": "{SERVING_CAPACITY}"}}]'
    )
    user = {**_env_without_capacities(), "LRU_CACHE_CAPACITY": "0"}
    kept = subprocess.run([sys.executable, "-c", code], env=user, capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    assert (
        '[["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]' in kept.stdout and '"LRU_CACHE_CAPACITY": "0"' in kept.stdout
    )


def test_the_art_cli_sets_them_before_torch_loads() -> None:
    code = (
        "import os, sys\n"
        "sys.argv = ['art', '--help']\n"
        "from art_core.app import cli\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('CAPS', os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env_without_capacities(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"CAPS {SERVING_CAPACITY} {SERVING_CAPACITY}" in out.stdout
