"""bench/load.py and bench/soak.py, short: each starts a real `art serve` (tiny model) as a subprocess,
loads it over loopback and prints one JSON line last; the invariants of issue 18 hold on it.

The load runs twice: at the default capacity (everything served) and at `--max-queued-rows 2`, where
most of 120 simultaneous requests must be refused explicitly (429 with Retry-After) and the
server must serve normally right after. Also the benches' arithmetic (`bench/serve_load.py`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

LOAD_KEYS = {"requests", "ok", "rejected_429_503", "other_errors", "p50_s", "p99_s", "peak_rss_gb"}
SOAK_KEYS = {
    "train_steps",
    "train_rss_slope_mb_per_100_steps",
    "requests",
    "serve_rss_slope_mb_per_10k",
    "fd_start",
    "fd_end",
    "ok",
    "rejected_429_503",
    "other_errors",
}


@pytest.fixture
def serve_load(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/serve_load.py, imported as a bench script imports it (bench/ first on sys.path)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("serve_load")


def run_bench(script: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu: "), lines[0]  # the machine header comes first
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_load_bench_short_serves_every_request() -> None:
    result = run_bench("load.py", "--requests", "50")
    assert LOAD_KEYS <= set(result), result
    assert result["requests"] == 50 and result["other_errors"] == 0, result
    assert result["ok"] + result["rejected_429_503"] == 50
    assert result["ok"] == 50  # 50 rows fit the default capacity (max_queued_rows 2048)
    assert result["after_ok"] == result["after"] == 5
    assert 0 < result["p50_s"] <= result["p99_s"]
    assert 0.05 < result["peak_rss_gb"] < 8
    assert result["fds_after"] <= result["fds_before"]


def test_load_bench_past_capacity_refuses_with_retry_after_and_recovers() -> None:
    result = run_bench("load.py", "--requests", "120", "--max-queued-rows", "2")
    assert result["other_errors"] == 0, result["error_samples"]
    assert result["ok"] + result["rejected_429_503"] == 120
    assert result["ok"] >= 2 and result["rejected_429_503"] >= 1, result
    assert result["after_ok"] == result["after"] == 5  # normal service right after


def test_soak_bench_short() -> None:
    result = run_bench("soak.py", "--steps", "3", "--requests", "200", "--sample-every", "50")
    assert SOAK_KEYS <= set(result), result
    assert result["train_steps"] == 3
    assert result["requests"] == 200 and result["other_errors"] == 0, result["error_samples"]
    assert result["ok"] + result["rejected_429_503"] == 200
    assert result["fd_end"] <= result["fd_start"], result
    for key in ("train_rss_slope_mb_per_100_steps", "serve_rss_slope_mb_per_10k"):
        assert isinstance(result[key], float), result


def test_slope_is_least_squares(serve_load: ModuleType) -> None:
    slope = serve_load.slope
    assert slope([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert slope([0, 1, 2], [5.0, 5.0, 5.0]) == 0.0
    assert slope([0, 1, 2, 3], [0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)
    assert slope([1], [4.0]) == 0.0 and slope([2, 2], [1.0, 3.0]) == 0.0
    with pytest.raises(ValueError, match="as many"):
        slope([0, 1], [1.0])


def test_percentile_interpolates(serve_load: ModuleType) -> None:
    percentile = serve_load.percentile
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_classify_counts_a_refusal_as_explicit_only_with_retry_after(serve_load: ModuleType) -> None:
    classify, OK, OTHER, REJECTED = serve_load.classify, serve_load.OK, serve_load.OTHER, serve_load.REJECTED
    answer = {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}
    assert classify(200, {}, answer)[0] == OK
    assert classify(200, {}, {"choices": []})[0] == OTHER
    assert classify(429, {"retry-after": "2"}, {})[0] == REJECTED
    assert classify(503, {"retry-after": "1"}, {})[0] == REJECTED
    assert classify(503, {}, {})[0] == OTHER
    assert classify(429, {"retry-after": "soon"}, {})[0] == OTHER
    assert classify(500, {"retry-after": "1"}, {})[0] == OTHER
