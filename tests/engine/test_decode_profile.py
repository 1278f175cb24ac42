"""bench/decode_profile.py runs end to end on the tiny model (so the profile script does not rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_profile_tiny_prints_every_part_and_the_floor() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    argv = [sys.executable, str(ROOT / "bench" / "decode_profile.py"), "--tiny", "--threads", "1"]
    argv += ["--batches", "1,32", "--steps", "3", "--warmup", "1"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for part in ("matmul qkv", "matmul gate_up", "matmul down_proj", "matmul o_proj", "matmul lm_head",
                 "attention (KV append)", "norms", "rotary", "sampling",
                 "grammar masks", "Python overhead", "memory bandwidth", "batch 1:", "batch 32:",
                 "weight stream: gate_up", "floor without that overlap"):  # fmt: skip
        assert part in text, f"{part!r} missing from:\n{text}"
    # SDPA in bf16, two batched matmuls in float32 (the serving dtype the CPU's probes chose)
    assert "attention (SDPA)" in text or "attention (matmuls)" in text, text
    last = json.loads(text.strip().splitlines()[-1])
    assert set(last) == {"step_ms_b32", "floor_ms_b32", "fraction_of_floor"}
    assert last["step_ms_b32"] > 0 and last["floor_ms_b32"] > 0
    assert 0 < last["fraction_of_floor"]
    assert abs(last["fraction_of_floor"] - last["floor_ms_b32"] / last["step_ms_b32"]) < 0.01
