"""bench/crash_resume.py, short: three SIGKILLs (mid trajectory write, after the checkpoint, mid history
append), a restart after each, and a final unkilled run; nothing corrupt, no step lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_crash_resume_bench_short(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "crash_resume.py"),
            "--kills",
            "3",
            "--steps",
            "3",
            "--windows",
            "trajectories,checkpoint,history",
            "--root",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["kills"] == 3 and result["resumes_ok"] == 3, done.stdout
    assert result["corrupt"] == 0 and result["lost_steps"] == 0, done.stdout
    assert result["final_step"] == 3
