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
)


def _env_without_capacities() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}


def _python(code: str, env: dict[str, str] | None = None) -> str:
    """Run `code` in a fresh interpreter (no torch loaded yet); its stdout, after checking it exited 0."""
    env = _env_without_capacities() if env is None else env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_too_late_once_torch_is_loaded_and_a_negative_capacity_is_refused() -> None:
    env: dict[str, str] = {}
    assert bound_primitive_caches(env) == []  # the test process has torch loaded: it already read them
    assert env == {}
    with pytest.raises(ValueError, match=">= 0"):
        bound_primitive_caches(env, capacity=-1)


def test_a_fresh_process_bounds_both_caches_but_keeps_what_the_user_set() -> None:
    code = (
        "import json, os, sys\n"
        "from art_core.engine.onednn import CAPACITY_VARIABLES, bound_primitive_caches\n"
        "assert 'torch' not in sys.modules\n"
        "chosen = bound_primitive_caches()\n"
        "print(json.dumps([chosen, {name: os.environ[name] for name in CAPACITY_VARIABLES}]))\n"
    )
    assert _python(code).strip() == (
        f'[["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"], '
        f'{{"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "{SERVING_CAPACITY}", "LRU_CACHE_CAPACITY": "{SERVING_CAPACITY}"}}]'
    )
    user = {**_env_without_capacities(), "LRU_CACHE_CAPACITY": "0"}
    kept = _python(code, user)
    assert '[["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]' in kept and '"LRU_CACHE_CAPACITY": "0"' in kept


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
    assert f"CAPS {SERVING_CAPACITY} {SERVING_CAPACITY}" in _python(code)
