"""The "bf16" training precision on CPU: frozen base weights computed on bf16 copies (`training.bf16_base`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from art_core.models.hardware import cpu_has_native_bf16
from art_core.models.loading import LoadedModel
from art_core.training.batch import BatchTotals
from art_core.training.bf16_base import Bf16BaseWeights
from art_core.training.config import TrainConfig
from tests.tolerances import model_tolerance
from tests.training.test_trainer import make_batch
from tests.training.test_trainer_fast_paths import make_trainer

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


def _base_linears(model: nn.Module) -> list[Any]:
    return [m.base_layer for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


def test_within_the_block_each_base_layer_computes_on_its_bf16_copy(tiny_model: LoadedModel) -> None:
    # bf16 matmuls run on any CPU (slowly where they are not native), so this holds on every CI machine.
    trainer = make_trainer(tiny_model, True, TrainConfig())
    linears = _base_linears(trainer.model)
    copies = Bf16BaseWeights()
    x = torch.randn(5, linears[0].in_features)
    exact = linears[0](x)
    with copies.applied(trainer.model, trainer.adapter_name) as swapped:
        assert swapped == len(linears) > 0
        out = linears[0](x)
        expected = F.linear(x.bfloat16(), linears[0].weight.bfloat16()).float()
        assert out.dtype == torch.float32 and torch.equal(out, expected)
        assert not torch.equal(out, exact)  # rounded: the block really changed the computation
    assert all("forward" not in vars(linear) for linear in linears)
    assert torch.equal(linears[0](x), exact)
    assert copies.nbytes == sum(linear.weight.numel() * 2 for linear in linears)


def test_a_copy_is_kept_while_its_weight_is_unchanged_and_made_again_after_a_write() -> None:
    linear = nn.Linear(8, 4, bias=False).requires_grad_(False)
    copies = Bf16BaseWeights()
    first = copies.weight(linear)
    assert copies.weight(linear) is first
    with torch.no_grad():
        linear.weight.mul_(2)  # an in-place write bumps the version counter
    second = copies.weight(linear)
    assert second is not first and torch.equal(second, linear.weight.bfloat16())


def test_trainable_or_already_replaced_base_layers_keep_their_own_forward(tiny_model: LoadedModel) -> None:
    trainer = make_trainer(tiny_model, True, TrainConfig())
    linears = _base_linears(trainer.model)
    linears[0].weight.requires_grad_(True)  # e.g. a full fine-tune of that layer
    replaced = linears[1]
    replaced.forward = lambda x: x  # someone else's hook
    with Bf16BaseWeights().applied(trainer.model, trainer.adapter_name) as swapped:
        assert swapped == len(linears) - 2
        assert "forward" not in vars(linears[0])
        assert vars(replaced)["forward"](torch.ones(1)).item() == 1.0
    assert "forward" in vars(replaced)  # left as it was


def _grads(tiny_model: LoadedModel, precision: str) -> torch.Tensor:
    config = dataclasses.replace(TrainConfig(learning_rate=1e-2), matmul_precision=precision)  # type: ignore[arg-type]
    trainer = make_trainer(tiny_model, True, config, exact=False)
    batch = make_batch()
    trainer.forward_backward(batch.examples, totals=BatchTotals.of(batch.examples))
    return torch.cat([p.grad.flatten() for p in trainer.params])  # type: ignore[union-attr]


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="the bf16 precision needs a CPU with native bf16")
def test_the_bf16_precision_rounds_the_base_matmuls_and_stays_close_to_exact(
    tiny_model: LoadedModel,
) -> None:
    exact, bf16 = _grads(tiny_model, "ieee"), _grads(tiny_model, "bf16")
    relative = float((bf16 - exact).norm() / exact.norm())
    model = tiny_model.model
    # More than float32 rounding explains (oneDNN's fast-math mode computes exact float32 on CPUs
    # without AMX: it must not be what runs), and no more than bf16 rounding of the forward and
    # backward does.
    assert relative > model_tolerance(model, torch.float32, scale=1.0, backward=True), relative
    assert relative <= model_tolerance(model, torch.bfloat16, scale=1.0, backward=True), relative
    cosine = F.cosine_similarity(bf16, exact, dim=0)
    assert cosine > 0.99, f"bf16 base matmuls turn the gradient elsewhere (cosine {cosine:.4f})"
