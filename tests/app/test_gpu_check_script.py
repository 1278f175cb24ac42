"""The parts of scripts/gpu_check.{sh,py} that run without a GPU: shell syntax, arguments, the
`art serve` command it starts (with --train-procs where 2 GPUs exist), and its refusal without CUDA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shell_script_parses() -> None:
    result = subprocess.run(
        ["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_train_procs_is_two_with_two_gpus_and_checked() -> None:
    check = gpu_check()
    assert check.train_procs("auto", "cuda", 2) == 2
    assert check.train_procs("auto", "cuda", 1) == 1
    assert check.train_procs("auto", "cpu", 0) == 1
    assert check.train_procs("2", "cpu", 0) == 2  # gloo ranks on CPU
    with pytest.raises(SystemExit, match="CUDA devices"):
        check.train_procs("4", "cuda", 2)


def test_serve_command_passes_train_procs_to_art_serve(tmp_path: Path) -> None:
    check = gpu_check()
    args = check.parse_args(["--cpu"])
    args.procs = 2
    command = check.serve_command(args, "cpu", 1234, tmp_path)
    assert command[:5] == [sys.executable, "-m", "art_core.app.cli", "serve", "--engine"]
    assert command[command.index("--train-procs") + 1] == "2"
    args.procs = 1
    assert "--train-procs" not in check.serve_command(args, "cpu", 1234, tmp_path)


def test_gpu_run_fails_loudly_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    check = gpu_check()
    with pytest.raises(SystemExit, match="no CUDA device"):
        check.check_device(check.parse_args([]))
