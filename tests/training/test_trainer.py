"""Trainer primitives on the tiny_model random model: LoRA-only updates, learning direction, exact resume."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch import nn

from art_core.models.loading import LoadedModel
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.training.batch import BatchTotals, PreparedBatch, collate, micro_batches, prepare_batch
from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer
from tests.tolerances import assert_close_to_model, model_tolerance
from tests.training.dist_train import make_batch as distributed_batch

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

PAD = 0


def make_trainer(
    tiny_model: LoadedModel, config: TrainConfig | None = None, seed: int = 0, adapter_name: str = "default"
) -> Trainer:
    torch.manual_seed(seed)
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name=adapter_name)
    # These tests compare computations with each other at float32 tolerances, so the matmuls are
    # exact; the bf16 fast-math default ("auto") is tested in test_precision.py.
    config = dataclasses.replace(config or TrainConfig(learning_rate=1e-2), matmul_precision="ieee")
    return Trainer(model, pad_id=PAD, adapter_name=adapter_name, config=config)


def randomize_lora(trainer: Trainer, seed: int = 1) -> None:
    """LoRA B starts at zero (so A gets no gradient); give it values so every weight is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.params:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def make_batch(seed: int = 0, groups: int = 2, size: int = 4) -> PreparedBatch:
    """`dist_train.make_batch` (random prompts and completions, rewards alternating 1/0), two
    groups by default."""
    return distributed_batch(seed, groups, size)


def lora_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: param.detach().clone() for name, param in zip(trainer.param_names, trainer.params, strict=True)
    }


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_train_step_changes_only_lora_weights(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora_before = lora_state(trainer)
    metrics = trainer.train_step(make_batch())
    assert metrics["trained"] == 1.0 and metrics["grad_norm"] > 0 and metrics["optim_step_skipped"] == 0
    for name, param in trainer.model.named_parameters():
        if "lora_" not in name:
            assert not param.requires_grad and torch.equal(param, base_before[name]), name
    changed = [
        n
        for n, p in zip(trainer.param_names, trainer.params, strict=True)
        if not torch.equal(p, lora_before[n])
    ]
    assert changed == [n for n in trainer.param_names if "lora_B" in n]  # A gets no gradient while B == 0
    assert not trainer.model.training  # eval mode restored for the inference engine


def test_trainer_logprobs_match_a_naive_forward(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, TrainConfig(logprob_chunk_size=7))
    randomize_lora(trainer)
    examples = make_batch().examples
    batch = collate(examples, PAD)
    ours = trainer.compute_logprobs(examples)
    full = torch.log_softmax(logits(trainer.model, batch["input_ids"]).float(), dim=-1)
    naive = full.gather(-1, batch["targets"].clamp(min=0)[..., None])[..., 0]
    real = batch["attention_mask"].bool()
    assert_close_to_model(ours[real], naive[real], trainer.model, torch.float32)
    assert (ours[~real] == 0).all()


def test_training_never_runs_the_output_head_on_whole_sequences(tiny_model: LoadedModel) -> None:
    # Full [B, T, V] logits come only from calling lm_head as a module; the chunked path uses its weight.
    trainer = make_trainer(tiny_model)
    calls: list[tuple[int, ...]] = []
    head = trainer.model.get_base_model().lm_head
    handle = head.register_forward_hook(lambda module, args, output: calls.append(tuple(output.shape)))
    try:
        trainer.train_step(make_batch())
        trainer.compute_logprobs(make_batch().examples)
    finally:
        handle.remove()
    assert calls == []


def test_grpo_raises_logprob_of_positive_advantage_completions(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, TrainConfig(learning_rate=5e-3, loss=LossConfig(tis_cap=None)))
    batch = make_batch()
    collated = collate(batch.examples, PAD)
    advantages = collated["advantages"]

    def mean_completion_logprob(sign: float) -> float:
        logprobs = trainer.compute_logprobs(batch.examples)
        rows = (advantages * sign) > 0
        mask = collated["mask"][rows]
        return float((logprobs[rows] * mask).sum() / mask.sum())

    positive, negative = mean_completion_logprob(1.0), mean_completion_logprob(-1.0)
    for _ in range(5):
        trainer.train_step(batch)
    assert mean_completion_logprob(1.0) > positive + 0.5
    assert mean_completion_logprob(-1.0) < negative


def test_two_micro_batches_give_the_same_gradients_as_one(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, TrainConfig(loss=LossConfig(name="grpo", kl_coef=0.1)))
    randomize_lora(trainer)
    batch = make_batch()
    totals = BatchTotals.of(batch.examples)

    def grads(micro_batch_tokens: int) -> tuple[int, list[torch.Tensor], float]:
        chunks = micro_batches(batch.examples, micro_batch_tokens)
        loss = sum(trainer.forward_backward(chunk, totals=totals)["loss"] for chunk in chunks)
        result = [p.grad.clone() for p in trainer.params]  # type: ignore[union-attr]
        trainer.optimizer.zero_grad(set_to_none=True)
        return len(chunks), result, loss

    n_one, one, loss_one = grads(10_000)
    n_many, many, loss_many = grads(40)
    assert n_one == 1 and n_many >= 2
    assert loss_one == pytest.approx(
        loss_many, abs=model_tolerance(trainer.model, torch.float32, scale=abs(loss_one))
    )
    for a, b in zip(one, many, strict=True):  # gradients: through the forward and the backward
        assert_close_to_model(b, a, trainer.model, torch.float32, backward=True)


def groups_with_idle(idle: int) -> list[TrajectoryGroup]:
    """Two groups of four with rewards 1/0/1/0, then `idle` groups whose four rewards are equal."""
    generator = torch.Generator().manual_seed(0)
    result = []
    for g in range(2 + idle):
        prompt = torch.randint(10, 2000, (6,), generator=generator).tolist()
        trajectories = []
        for i in range(4):
            completion = torch.randint(10, 2000, (3 + 2 * i,), generator=generator).tolist()
            turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[math.nan] * len(completion))
            trajectories.append(Trajectory(turns=[turn], reward=float(i % 2) if g < 2 else 1.0))
        result.append(TrajectoryGroup(trajectories))
    return result


@pytest.mark.parametrize("over", ["scored", "trained"])
def test_a_zero_variance_group_counts_in_the_loss_mean_unless_told_otherwise(
    tiny_model: LoadedModel, over: str
) -> None:
    """GRPO's batch mean: two idle groups beside two informative ones halve the gradient (the
    same examples train, over 16 sequences instead of 8); normalised over the trained ones alone
    ("trained"), the gradient does not change."""
    config = TrainConfig(learning_rate=1e-2, loss=LossConfig(tis_cap=None, normalise_over=over))
    norms = []
    for idle in (0, 2):
        trainer = make_trainer(tiny_model, config)
        randomize_lora(trainer)
        batch = prepare_batch(groups_with_idle(idle), scale_rewards=True, max_context=2048)
        assert len(batch.examples) == 8 and batch.metrics["sequences_scored"] == 8 + 4 * idle
        norms.append(trainer.train_step(batch)["grad_norm"])
    expected = norms[0] / 2 if over == "scored" else norms[0]
    assert norms[1] == pytest.approx(
        expected, abs=model_tolerance(tiny_model.model, torch.float32, scale=norms[0], backward=True)
    )


def test_kl_metrics_reported_and_zero_without_adapter_change(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, TrainConfig(loss=LossConfig(kl_coef=0.5)))
    metrics = trainer.train_step(make_batch())
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B == 0: policy equals the reference
    metrics = trainer.train_step(make_batch())
    assert metrics["kl"] > 0 and "kl_loss" in metrics


def test_empty_batch_takes_no_step(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model)
    before = lora_state(trainer)
    empty = PreparedBatch(examples=[], metrics={"groups_zero_variance": 1.0}, warnings=["group 0 skipped"])
    assert trainer.train_step(empty) == {"trained": 0.0}
    assert not trainer.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in zip(trainer.param_names, trainer.params, strict=True))


def test_non_finite_gradient_skips_the_update(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model)
    before = lora_state(trainer)
    poisoned = [dataclasses.replace(e, advantage=math.nan) for e in make_batch().examples]
    metrics = trainer.train_step(PreparedBatch(examples=poisoned, metrics={}))
    assert metrics["optim_step_skipped"] == 1.0 and metrics["trained"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in zip(trainer.param_names, trainer.params, strict=True))
    assert all(p.grad is None for p in trainer.params)


def saved_files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("adapter_name", ["default", "live"])
def test_save_and_load_state_resume_exactly(
    tiny_model: LoadedModel, tmp_path: Path, adapter_name: str
) -> None:
    config = TrainConfig(learning_rate=1e-2, weight_decay=0.01)
    first = make_trainer(tiny_model, config, seed=0, adapter_name=adapter_name)
    batch = make_batch()
    first.train_step(batch)
    first.train_step(make_batch(seed=1))
    first.save_state(tmp_path)
    files = saved_files(tmp_path)
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
        "rng.safetensors",
    } <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle"))]

    second = make_trainer(tiny_model, config, seed=7, adapter_name=adapter_name)
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    second.load_state(tmp_path)
    # the trainer's own RNG (dropout) is restored; torch's global one is left alone
    assert torch.equal(second._rng["torch_cpu"], first._rng["torch_cpu"])
    assert torch.equal(torch.get_rng_state(), global_state)
    probe = torch.tensor([[5, 17, 300, 42, 9, 1000]])
    assert torch.equal(logits(first.model, probe), logits(second.model, probe))
    first.train_step(batch)
    second.train_step(batch)
    for a, b in zip(first.params, second.params, strict=True):
        assert torch.equal(a, b)


def test_saved_adapter_loads_with_peft(tiny_model: LoadedModel, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model, adapter_name="live")
    trainer.train_step(make_batch())
    trainer.save_state(tmp_path)
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model.model), str(tmp_path))
    probe = torch.tensor([[5, 17, 300, 42, 9, 1000]])
    assert torch.equal(logits(loaded, probe), logits(trainer.model, probe))
    assert not torch.equal(logits(tiny_model.model, probe), logits(loaded, probe))


def test_load_state_rejects_a_different_adapter_layout(tiny_model: LoadedModel, tmp_path: Path) -> None:
    make_trainer(tiny_model).save_state(tmp_path)
    torch.manual_seed(0)
    other = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="different adapter layout"):
        Trainer(other, pad_id=PAD, config=TrainConfig()).load_state(tmp_path)


def test_attach_lora_freezes_the_base_model(tiny_model: LoadedModel) -> None:
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=2))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * tiny_model.model.config.num_hidden_layers
    assert not any(module.training for module in model.modules())  # stays in eval mode like the base
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(r=0)


def test_training_leaves_another_active_adapter_alone(tiny_model: LoadedModel, tmp_path: Path) -> None:
    # An inference engine sharing the model may have a checkpoint adapter active between steps.
    trainer = make_trainer(tiny_model, adapter_name="live")
    trainer.train_step(make_batch())
    trainer.save_state(tmp_path)
    trainer.model.load_adapter(str(tmp_path), adapter_name="step1")
    trainer.model.set_adapter("step1")
    step1 = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".step1." in n}
    live_before = lora_state(trainer)
    trainer.train_step(make_batch(seed=1))
    assert trainer.model.active_adapter == "step1" and not trainer.model.training
    assert all(torch.equal(p, step1[n]) for n, p in trainer.model.named_parameters() if ".step1." in n)
    assert any(
        not torch.equal(p, live_before[n]) for n, p in zip(trainer.param_names, trainer.params, strict=True)
    )
