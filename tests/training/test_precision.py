"""The training matmul precision: what "auto" means, scoping, and its effect on a real train step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from art_core.models.loading import LoadedModel
from art_core.training import precision
from art_core.training.batch import BatchTotals
from art_core.training.config import TrainConfig
from art_core.training.precision import cpu_has_native_bf16, matmul_precision, resolve_precision
from tests.training.test_trainer import make_batch
from tests.training.test_trainer_fast_paths import make_trainer

CPU = torch.device("cpu")


def test_auto_is_bf16_exactly_where_the_cpu_has_native_bf16() -> None:
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_has_native_bf16() else "ieee")
    assert resolve_precision("auto", torch.device("cuda")) == "tf32"
    assert resolve_precision("ieee", CPU) == "ieee"


def test_bf16_on_a_cpu_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", CPU) == "ieee"
    with pytest.raises(ValueError, match="native bf16"):
        resolve_precision("bf16", CPU)


def test_unknown_precisions_are_rejected() -> None:
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        TrainConfig(matmul_precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one of"):
        resolve_precision("half", CPU)  # type: ignore[arg-type]


def test_the_setting_is_scoped_and_restored_even_on_error() -> None:
    backend = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    before = backend.fp32_precision
    with matmul_precision("ieee", CPU) as concrete:
        assert concrete == "ieee" and backend.fp32_precision == "ieee"
    assert backend.fp32_precision == before
    with pytest.raises(RuntimeError, match="boom"), matmul_precision("auto", CPU):
        raise RuntimeError("boom")
    assert backend.fp32_precision == before


def _loss_and_grads(tiny_model: LoadedModel, config: TrainConfig) -> tuple[float, torch.Tensor]:
    trainer = make_trainer(tiny_model, True, config, exact=False)
    batch = make_batch()
    loss = trainer.forward_backward(batch.examples, totals=BatchTotals.of(batch.examples))["loss"]
    grads = torch.cat([p.grad.flatten() for p in trainer.params])  # type: ignore[union-attr]
    return loss, grads


def test_a_train_step_uses_the_precision_and_stays_close_to_exact(tiny_model: LoadedModel) -> None:
    config = TrainConfig(learning_rate=1e-2)
    exact_loss, exact = _loss_and_grads(tiny_model, dataclasses.replace(config, matmul_precision="ieee"))
    again_loss, again = _loss_and_grads(tiny_model, dataclasses.replace(config, matmul_precision="ieee"))
    auto_loss, auto = _loss_and_grads(tiny_model, config)
    assert again_loss == exact_loss and torch.equal(again, exact)  # exact mode is deterministic
    if not cpu_has_native_bf16():
        assert auto_loss == exact_loss and torch.equal(auto, exact)
        return
    assert not torch.equal(auto, exact), "auto should compute the matmuls in bf16 on this CPU"
    assert auto_loss == pytest.approx(exact_loss, rel=0.05, abs=1e-3)
    cosine = torch.nn.functional.cosine_similarity(auto, exact, dim=0)
    assert cosine > 0.99, f"bf16 matmul gradients point elsewhere (cosine {cosine:.4f})"
