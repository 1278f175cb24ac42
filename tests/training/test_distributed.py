"""Data-parallel training under torchrun (gloo on CPU): two ranks give the LoRA one process gives.

tests/training/dist_train.py trains the tiny model for K=3 steps (a checkpoint written by rank 0
and resumed from by every rank halfway) in one process, under `torchrun --nproc-per-node 2`, and
under torchrun with the base's Linear layers sharded by FSDP2. The weights must agree within the
float-rounding bound on AdamW's updates that the one-process run derives (dist_train's
`add_update_bound`), and the per-step loss and pre-clip gradient norm within the model's rounding
tolerance: a gradient averaged instead of summed over the ranks halves the norm; a rank's share
dropped or counted twice moves the weights by about a learning rate, far beyond the bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from art_core.app.processes import free_port
from art_core.models.loading import load_model
from art_core.training.distributed import World, assign_shares, world_from_env
from tests.tolerances import model_tolerance

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "training" / "dist_train.py"
STEPS = 3


def run_training(out: Path, *, procs: int, fsdp: bool = False) -> tuple[dict[str, torch.Tensor], list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    script = [str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *(["--fsdp"] if fsdp else [])]
    if procs == 1:
        command = [sys.executable, *script]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(procs)]
        command = [sys.executable, *launcher, "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        command += script
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(str(out / "lora.safetensors")), json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], dict]:
    out = tmp_path_factory.mktemp("one")
    weights, metrics = run_training(out, procs=1)
    return weights, metrics, load_file(str(out / "bound.safetensors"))


def assert_same_training(one: tuple[dict, list[dict], dict], weights: dict, metrics: list[dict]) -> None:
    ref_weights, ref_metrics, bound = one
    model = load_model("tiny-random").model
    assert len(metrics) == len(ref_metrics) == STEPS
    for ours, ref in zip(metrics, ref_metrics, strict=True):
        assert ours["trained"] == ref["trained"] == 1.0
        assert ours["micro_batches"] == ref["micro_batches"] and ours["tokens"] == ref["tokens"]
        for key in ("loss", "grad_norm"):
            tolerance = model_tolerance(
                model, torch.float32, scale=abs(ref[key]), backward=key == "grad_norm"
            )
            assert ours[key] == pytest.approx(ref[key], abs=tolerance), key
    assert sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        excess = (weights[name] - ref).abs() - bound[name]
        assert float(excess.max()) <= 0, f"{name}: off by {float(excess.max())} beyond the rounding bound"
    # The bound is tight where it matters: most weights' bound is far below one AdamW step (lr).
    all_bounds = torch.cat([b.flatten() for b in bound.values()])
    assert float((all_bounds < 0.1 * 1e-2).float().mean()) > 0.9


def test_assign_shares_balances_tokens_deterministically() -> None:
    assert assign_shares([10, 40, 30, 20], 2) == [[0, 1], [2, 3]]  # 40+10 | 30+20
    assert assign_shares([5], 3) == [[0], [], []]
    assert sorted(i for share in assign_shares([3, 1, 4, 1, 5, 9, 2, 6], 3) for i in share) == list(range(8))
    with pytest.raises(ValueError, match="world_size"):
        assign_shares([1], 0)


def test_world_from_env_reads_torchrun_variables() -> None:
    assert world_from_env({}, cuda=False) is None
    assert world_from_env({"WORLD_SIZE": "1"}, cuda=False) is None
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert world_from_env(env, cuda=True) == World(rank=1, world_size=2, local_rank=1, device="cuda:1")
    assert world_from_env(env, cuda=False).backend == "gloo"  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="torchrun"):
        world_from_env({"WORLD_SIZE": "2"}, cuda=False)
    with pytest.raises(ValueError, match="rank"):
        World(rank=2, world_size=2)


@pytest.mark.slow
def test_two_ddp_ranks_train_the_lora_one_process_does(one_process: tuple, tmp_path: Path) -> None:
    weights, metrics = run_training(tmp_path, procs=2)
    assert_same_training(one_process, weights, metrics)


@pytest.mark.slow
def test_two_fsdp2_ranks_train_the_lora_one_process_does(one_process: tuple, tmp_path: Path) -> None:
    weights, metrics = run_training(tmp_path, procs=2, fsdp=True)
    assert_same_training(one_process, weights, metrics)
