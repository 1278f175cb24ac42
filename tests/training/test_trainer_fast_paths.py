"""The trainer's speed paths give the same numbers as the plain ones: frozen-head log-probs, shared prefixes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import Tensor

from art_core.models.loading import LoadedModel, load_model
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory, Turn
from art_core.training.batch import BatchTotals, PreparedBatch, collate, prepare_batch
from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
from art_core.training.forward import fused_lora
from art_core.training.logprobs import IGNORE_INDEX, token_logprobs
from art_core.training.lora import attach_lora
from art_core.training.trainer import Trainer
from tests.tolerances import assert_close_to_model, model_tolerance

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

PAD = 0
B, T, H, V = 3, 5, 8, 11


def naive(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor) -> tuple[Tensor, Tensor]:
    logp = torch.log_softmax(torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float(), -1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    picked = torch.where(targets >= 0, picked, torch.zeros(()))
    return picked, -(logp.exp() * logp).sum(-1)


def frozen_head(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, torch.nn.Linear, Tensor]:
    torch.manual_seed(seed)
    hidden = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=True).to(dtype).requires_grad_(False)
    targets = torch.randint(0, V, (B, T))
    targets[0, -1] = IGNORE_INDEX
    return hidden, head, targets


@pytest.mark.parametrize("chunk_size", [1, 4, B * T, 64])
def test_frozen_head_matches_naive_in_value_entropy_and_gradient(chunk_size: int) -> None:
    hidden, head, targets = frozen_head(0)
    upstream = torch.randn(B, T)
    logprobs, entropy = token_logprobs(hidden, head, targets, chunk_size=chunk_size, with_entropy=True)
    (grad,) = torch.autograd.grad((logprobs * upstream).sum(), [hidden])
    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    (want,) = torch.autograd.grad((expected * upstream).sum(), [hidden])
    torch.testing.assert_close(logprobs, expected)
    assert entropy is not None and not entropy.requires_grad
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(grad, want)
    assert logprobs[0, -1] == 0 and grad[0, -1].abs().sum() == 0  # an ignored target has no gradient


def test_frozen_head_bf16() -> None:
    hidden, head, targets = frozen_head(1, torch.bfloat16)
    logprobs, _ = token_logprobs(hidden, head, targets, chunk_size=4)
    assert logprobs.dtype == torch.float32
    expected, _ = naive(hidden, head.weight, head.bias, targets)
    torch.testing.assert_close(logprobs, expected)
    (grad,) = torch.autograd.grad(logprobs.sum(), [hidden])
    (want,) = torch.autograd.grad(expected.sum(), [hidden])
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, want, rtol=2e-2, atol=2e-2)


def test_frozen_head_keeps_only_hidden_sized_tensors_for_backward() -> None:
    hidden, head, targets = frozen_head(2)
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, head, targets, chunk_size=4)
    assert saved and all(shape[-1] != V for shape in saved)
    saved.clear()
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, head, targets, chunk_size=4)
    assert saved == []


def one_group_batch(seed: int = 0, size: int = 4, prompt_len: int = 9) -> PreparedBatch:
    """One group: the same prompt, completions of varied lengths (so rows are padded), rewards 1/0."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=generator).tolist()

    prompt = ids(prompt_len)
    trajectories = []
    for i in range(size):
        completion = ids(3 + 2 * i)
        turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion))
        trajectories.append(Trajectory(turns=[turn], reward=float(i % 2)))
    return prepare_batch([TrajectoryGroup(trajectories)], scale_rewards=True, max_context=2048)


def make_trainer(tiny_model: LoadedModel, share: bool, config: TrainConfig, exact: bool = True) -> Trainer:
    torch.manual_seed(0)
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    # Exact float32 matmuls: these tests compare paths at float32 tolerances (see test_precision.py).
    if exact:
        config = dataclasses.replace(config, matmul_precision="ieee")
    return Trainer(model, pad_id=PAD, config=config, share_prefixes=share)


def test_shared_prefix_gives_the_same_loss_and_gradients(tiny_model: LoadedModel) -> None:
    config = TrainConfig(loss=LossConfig(name="grpo", kl_coef=0.1))
    batch = one_group_batch()
    totals = BatchTotals.of(batch.examples)
    results = []
    for share in (True, False):
        trainer = make_trainer(tiny_model, share, config)
        metrics = trainer.forward_backward(batch.examples, totals=totals)
        results.append((metrics, [p.grad.clone() for p in trainer.params]))  # type: ignore[union-attr]
    (shared, shared_grads), (plain, plain_grads) = results
    assert shared["shared_prefix_tokens"] == 9 and plain["shared_prefix_tokens"] == 0
    model = tiny_model.model
    for name in ("loss", "kl"):
        bound = model_tolerance(model, torch.float32, scale=abs(plain[name]), backward=False)
        assert shared[name] == pytest.approx(plain[name], abs=bound)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        assert_close_to_model(a, b, model, torch.float32, backward=True)


def test_shared_prefix_logprobs_match_a_naive_forward(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, True, TrainConfig(logprob_chunk_size=7))
    examples = one_group_batch(seed=3).examples
    batch = collate(examples, PAD)
    assert trainer.shared_prefix_length(batch["input_ids"], batch["attention_mask"]) == 9
    ours = trainer.compute_logprobs(examples)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    full = torch.log_softmax(logits.float(), dim=-1)
    expected = full.gather(-1, batch["targets"].clamp(min=0)[..., None])[..., 0]
    real = batch["attention_mask"].bool()
    assert_close_to_model(ours[real], expected[real], trainer.model, torch.float32)
    assert (ours[~real] == 0).all()


def test_shared_prefix_length_rules(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, True, TrainConfig())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11]])
    full = torch.ones_like(ids)
    assert trainer.shared_prefix_length(ids, full) == 5
    assert trainer.shared_prefix_length(ids[:1], full[:1]) == 0  # one row: nothing to share
    assert trainer.shared_prefix_length(ids[:, :5], full[:, :5]) == 4  # each row keeps a token of its own
    short = full.clone()
    short[1, 4:] = 0  # row 1 is padded after 4 tokens
    assert trainer.shared_prefix_length(ids, short) == 0  # 3 shared tokens: below MIN_SHARED_PREFIX
    different = ids.clone()
    different[1, 0] = 99
    assert trainer.shared_prefix_length(different, full) == 0
    plain = make_trainer(tiny_model, False, TrainConfig())
    assert plain.shared_prefix_length(ids, full) == 0


def two_groups_batch() -> PreparedBatch:
    """Two groups of 4 whose prompts share 6 leading tokens (a system prompt) and then differ."""
    generator = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=generator).tolist()

    system = ids(6)
    groups = []
    for g in range(2):
        prompt = system + ids(5)
        trajectories = []
        for i in range(4):
            completion = ids(2 + 3 * i + g)
            turn = Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion))
            trajectories.append(Trajectory(turns=[turn], reward=float((i + g) % 2)))
        groups.append(TrajectoryGroup(trajectories))
    return prepare_batch(groups, scale_rewards=True, max_context=2048)


def test_train_step_packs_whole_groups_into_one_micro_batch(tiny_model: LoadedModel) -> None:
    batch = two_groups_batch()
    metrics = make_trainer(tiny_model, True, TrainConfig(learning_rate=1e-3)).train_step(batch)
    assert metrics["trained"] == 1.0 and metrics["micro_batches"] == 1.0
    assert metrics["shared_prefix_tokens"] == 6  # the system prompt; each group's prompt once more
    tight = make_trainer(tiny_model, True, TrainConfig(learning_rate=1e-3, micro_batch_tokens=100))
    assert tight.train_step(batch)["micro_batches"] == 2.0  # a budget of one group: one group each


def test_whole_groups_in_one_micro_batch_give_the_per_row_gradients(tiny_model: LoadedModel) -> None:
    examples = two_groups_batch().examples
    totals = BatchTotals.of(examples)
    results = []
    for share in (True, False):
        trainer = make_trainer(tiny_model, share, TrainConfig())
        metrics = trainer.forward_backward(examples, totals=totals)
        results.append((metrics, [p.grad.clone() for p in trainer.params]))  # type: ignore[union-attr]
    (shared, shared_grads), (plain, plain_grads) = results
    assert shared["shared_prefix_tokens"] == 6 and plain["shared_prefix_tokens"] == 0
    bound = model_tolerance(tiny_model.model, torch.float32, scale=abs(plain["loss"]), backward=False)
    assert shared["loss"] == pytest.approx(plain["loss"], abs=bound)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        assert_close_to_model(a, b, tiny_model.model, torch.float32, backward=True)


def test_fused_lora_matches_peft_and_restores_the_layers(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, True, TrainConfig())
    model = trainer.model
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 7]])

    def logits_and_grads() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits
        out.float().pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in trainer.params]  # type: ignore[union-attr]

    plain, plain_grads = logits_and_grads()
    with fused_lora(model, "default"):
        assert any("forward" in vars(m) for m in model.modules())
        fused, fused_grads = logits_and_grads()
        with model.disable_adapter(), torch.no_grad():
            base = model(input_ids=ids).logits
    assert not any("forward" in vars(m) for m in model.modules())
    assert_close_to_model(fused, plain, model, torch.float32)
    for a, b in zip(fused_grads, plain_grads, strict=True):
        assert_close_to_model(a, b, model, torch.float32, backward=True)
    with torch.no_grad():
        expected_base = tiny_model.model(input_ids=ids).logits
    torch.testing.assert_close(base, expected_base)


def test_bf16_base_trains_with_fp32_lora_close_to_fp32(tiny_model: LoadedModel) -> None:
    low = load_model("tiny-random", dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = attach_lora(low.model, LoRAConfig(r=4, alpha=8))
    trainer = Trainer(model, pad_id=PAD, config=TrainConfig(learning_rate=1e-3, matmul_precision="ieee"))
    assert all(p.dtype == torch.float32 for p in trainer.params)  # peft keeps the adapter in fp32
    reference = make_trainer(tiny_model, True, TrainConfig())
    with torch.no_grad():  # the same LoRA weights as the fp32 reference
        for ours, theirs in zip(trainer.params, reference.params, strict=True):
            ours.copy_(theirs)
    examples = one_group_batch(seed=6).examples
    mask = collate(examples, PAD)["mask"] > 0
    low_logprobs = trainer.compute_logprobs(examples)
    # bf16 rounds every layer's outputs: the bound is bf16's, over the model's reductions and depth
    assert_close_to_model(
        low_logprobs[mask], reference.compute_logprobs(examples)[mask], model, torch.bfloat16
    )
    metrics = trainer.train_step(PreparedBatch(examples=examples, metrics={}))
    assert metrics["trained"] == 1.0 and metrics["shared_prefix_tokens"] == 9
