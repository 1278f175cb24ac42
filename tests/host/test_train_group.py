"""`ModelService(train_group=TrainGroup.spawn(2))`: two gloo training ranks train (and resume)
the tiny model's LoRA as the one-process service does, through the service's own train path; with
`fsdp=True` (`art serve --train-procs 2 --fsdp`) each rank's base is sharded by FSDP2 and the same
holds, the checkpoints have the one-process files, and the engine (a replica process, since the
sharded model cannot serve) samples what a model loaded with the checkpoint's LoRA samples.

The weights must agree within the float-rounding bound on AdamW's updates derived from the
one-process run (tests/training/dist_train.py, `add_update_bound`), the gradient norm within the
model's rounding tolerance (an average instead of a sum over the ranks would halve it).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from art_core.app.cli import app
from art_core.backends import LocalBackend
from art_core.engine.config import GenerationRequest
from art_core.engine.protocol import Completion
from art_core.engine.replicas import ReplicatedEngine
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.engine import TorchEngine
from art_core.host.records import ModelSpec, TrainResult
from art_core.host.service import LIVE_ADAPTER, ModelService
from art_core.host.serving import TorchServing
from art_core.host.torch_replicas import ProcessLora
from art_core.host.train_group import (
    FSDPSetupError,
    TrainGroup,
    config_from_json,
    config_to_json,
    examples_from_json,
    examples_to_json,
)
from art_core.host.train_worker import train_group_for
from art_core.models.loading import load_model
from art_core.storage import ModelStorage
from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
from art_core.training.distributed import World
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer
from tests.tolerances import model_tolerance
from tests.training.dist_train import add_update_bound, make_batch, record_grad_scales

SPEC = ModelSpec(project="dist", name="tiny", base_model="tiny-random", lora=LoRAConfig(r=4, alpha=8))
CONFIG = TrainConfig(learning_rate=1e-2, micro_batch_tokens=40, matmul_precision="ieee")


def groups(seed: int) -> list:
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn

    generator = torch.Generator().manual_seed(seed)
    result = []
    for g in range(4):  # the last group's rewards are equal: it counts in the loss's mean, untrained
        prompt = torch.randint(10, 2000, (6,), generator=generator).tolist()
        trajectories = [
            Trajectory(
                turns=[
                    Turn(
                        prompt_ids=prompt,
                        completion_ids=(
                            ids := torch.randint(10, 2000, (3 + 2 * i,), generator=generator).tolist()
                        ),
                        logprobs=[-1.0] * len(ids),
                    )
                ],
                reward=float(i % 2) if g < 3 else 1.0,
            )
            for i in range(4)
        ]
        result.append(TrajectoryGroup(trajectories))
    return result


PROMPT = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6), LIVE_ADAPTER)


@dataclass
class Run:
    """What a service trained: its storage, the last checkpoint's folder and LoRA, each step's
    result, and the greedy completion its engine served of `PROMPT` after the last step."""

    storage: ModelStorage
    checkpoint: Path
    weights: dict[str, torch.Tensor]
    results: list[TrainResult]
    served: Completion


def train(
    path: Path, procs: int, steps: range, *, fsdp: bool = False, bound: dict[str, torch.Tensor] | None = None
) -> Run:
    """`steps` train steps of a new service on `procs` processes (it resumes what `path` holds);
    `bound`: add the one-process trainer's rounding bound on each step's update to it."""
    group = TrainGroup.spawn(procs, fsdp=fsdp) if procs > 1 else None
    service = ModelService(path, train_group=group)
    try:
        trainer = service.register(SPEC).trainer
        scales = record_grad_scales(trainer) if bound is not None else {}
        if bound is not None:
            bound.update(
                {n: torch.zeros_like(p) for n, p in zip(trainer.param_names, trainer.params, strict=True)}
            )
        results = []
        for step in steps:
            results.append(asyncio.run(service.train(SPEC.name, groups(step), CONFIG)))
            if bound is not None:
                add_update_bound(trainer, bound, scales)
        hosted = service.committed(SPEC.name)  # the last step's commit runs in the background
        checkpoint = hosted.storage.checkpoint_dir(hosted.step)
        weights = load_file(str(checkpoint / "adapter_model.safetensors"))
        (served,) = asyncio.run(hosted.engine.generate(PROMPT))
        if fsdp:  # the sharded model serves nothing: a replica process, on its own weights, does
            assert isinstance(hosted.engine, ReplicatedEngine) and isinstance(hosted.copies, ProcessLora)
        return Run(hosted.storage, checkpoint, weights, results, served)
    finally:
        service.close()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, torch.Tensor]]:
    """Two steps in one process, and the rounding bound on their weights (by parameter name)."""
    bound: dict[str, torch.Tensor] = {}
    return train(tmp_path_factory.mktemp("one"), 1, range(2), bound=bound), bound


def assert_trains_like_one(
    one: tuple[Run, dict[str, torch.Tensor]], results: list[TrainResult], weights: dict[str, torch.Tensor]
) -> None:
    """The same steps, gradient norms within rounding, every weight within the derived bound."""
    reference, bound = one
    model = load_model("tiny-random").model
    for ours, theirs_result in zip(results, reference.results, strict=True):
        assert ours.trained and theirs_result.trained and ours.step == theirs_result.step
        mine, theirs = ours.metrics, theirs_result.metrics
        assert mine["data/step_trainer_tokens"] == theirs["data/step_trainer_tokens"]
        norm = theirs["loss/grad_norm"]
        tolerance = model_tolerance(model, torch.float32, scale=norm, backward=True)
        assert mine["loss/grad_norm"] == pytest.approx(norm, abs=tolerance)
    saved_bound = {_saved_key(name): b for name, b in bound.items()}
    assert sorted(weights) == sorted(reference.weights) == sorted(saved_bound)
    for key, ref in reference.weights.items():
        excess = (weights[key] - ref).abs() - saved_bound[key]
        assert float(excess.max()) <= 0, f"{key}: off by {float(excess.max())} beyond the rounding bound"
    # The bound is tight where it matters: most weights' bound is far below one AdamW step (lr), by
    # which a lost, doubled or stale share would move them.
    all_bounds = torch.cat([b.flatten() for b in bound.values()])
    assert float((all_bounds < 0.1 * CONFIG.learning_rate).float().mean()) > 0.9


def _saved_key(param_name: str) -> str:
    """The key peft saves a LoRA parameter under (no adapter name, `base_model.model.` prefix kept)."""
    return param_name.replace(f".{LIVE_ADAPTER}.", ".")


def assert_same_checkpoint_format(ours: Path, reference: Path) -> None:
    """The same files; the same tensors (names, dtypes, shapes) in each safetensors file; the same
    adapter config and trainer state (parameter names, AdamW hyper-parameters)."""
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in reference.iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            assert _layout(ours / name) == _layout(reference / name), name
    for name in ("adapter_config.json", "trainer_state.json"):
        assert json.loads((ours / name).read_text()) == json.loads((reference / name).read_text()), name


def _layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="pt") as f:
        return {
            key: (str(f.get_slice(key).get_dtype()), tuple(f.get_slice(key).get_shape())) for key in f.keys()
        }


def served_from(checkpoint: Path) -> tuple[Completion, torch.dtype]:
    """The greedy completion of `PROMPT` by a TorchEngine on the base with `checkpoint`'s LoRA
    (unsharded, in this process), and the dtype it decoded in."""
    loaded = load_model(SPEC.base_model)
    model = attach_lora(loaded.model, SPEC.lora, adapter_name=LIVE_ADAPTER)
    Trainer(model, pad_id=0, adapter_name=LIVE_ADAPTER, config=TrainConfig()).load_state(checkpoint)
    engine = TorchEngine(model, loaded.tokenizer)
    try:
        (completion,) = asyncio.run(engine.generate(PROMPT))
        serving = engine.serving_model
    finally:
        engine.close()
    dtype = next(serving.parameters()).dtype if serving is not None else torch.float32
    return completion, dtype


def test_messages_round_trip_examples_and_config() -> None:
    batch = make_batch(seed=0)
    back = examples_from_json(json.loads(json.dumps(examples_to_json(batch.examples))))
    assert repr(back) == repr(batch.examples)  # repr: the NaN log-probs (NaN != NaN) compare too
    config = TrainConfig(
        learning_rate=3e-4, loss=LossConfig(name="dr_grpo", kl_coef=0.2), adam_betas=(0.8, 0.9)
    )
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config


def test_spawn_rejects_one_process() -> None:
    with pytest.raises(ValueError, match="2 or more"):
        TrainGroup.spawn(1)


def test_fsdp_without_several_training_processes_is_refused(tmp_path: Path) -> None:
    for procs in (None, 1):
        with pytest.raises(FSDPSetupError, match="pass --train-procs N with N >= 2"):
            train_group_for(procs, cuda=False, fsdp=True, env={})
    with pytest.raises(FSDPSetupError, match=r"LocalBackend\(train_procs=N, fsdp=True\)"):
        LocalBackend(tmp_path, fsdp=True)
    result = CliRunner().invoke(app, ["serve", "--fsdp", "--path", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "pass --train-procs N with N >= 2" in " ".join(result.output.split())


def test_fsdp_refuses_replica_threads_which_would_serve_the_sharded_model(tmp_path: Path) -> None:
    group = TrainGroup(World(rank=0, world_size=2), fsdp=True)  # never joined: nothing is sent
    threads = TorchServing(replicas=2, replica_processes=False)
    with pytest.raises(FSDPSetupError, match="use replica processes"):
        ModelService(tmp_path, threads, train_group=group)


@pytest.mark.slow
def test_two_training_processes_train_and_resume_like_one(one_process: tuple, tmp_path: Path) -> None:
    first = train(tmp_path, 2, range(1))
    resumed = train(tmp_path, 2, range(1, 2))  # a new service resumes step 1
    assert_trains_like_one(one_process, first.results + resumed.results, resumed.weights)


@pytest.mark.slow
def test_two_fsdp_training_processes_train_resume_and_serve_like_one(
    one_process: tuple, tmp_path: Path
) -> None:
    first = train(tmp_path, 2, range(1), fsdp=True)
    # A new service: rank 0 loads checkpoint 1 into its sharded model and sends it to rank 1.
    resumed = train(tmp_path, 2, range(1, 2), fsdp=True)
    assert_trains_like_one(one_process, first.results + resumed.results, resumed.weights)
    assert_same_checkpoint_format(resumed.checkpoint, one_process[0].checkpoint)
    # The replica process serves step 2's LoRA (published after the step), not the step-1 one it
    # started from in the resumed service.
    expected, dtype = served_from(resumed.checkpoint)
    model = load_model(SPEC.base_model).model
    tolerance = model_tolerance(model, dtype, scale=max(abs(x) for x in expected.logprobs))
    assert resumed.served.token_ids == expected.token_ids
    assert resumed.served.logprobs == pytest.approx(expected.logprobs, abs=tolerance)
    stale, _ = served_from(resumed.storage.checkpoint_dir(1))
    moved = max(abs(a - b) for a, b in zip(stale.logprobs, expected.logprobs, strict=False))
    assert stale.token_ids != expected.token_ids or moved > tolerance
