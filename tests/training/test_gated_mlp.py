"""`gated_down`: a gated MLP's `down(act(gate) * up)` with a LoRA down projection as one autograd
node gives autograd's values and gradients, keeps less for backward, and the packed forward uses it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from art_core.models.loading import LoadedModel
from art_core.training import packed_forward
from art_core.training.config import LoRAConfig
from art_core.training.gated_mlp import activation_of, gated_down
from art_core.training.lora import attach_lora
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

ROWS, INTERMEDIATE, HIDDEN, RANK, SCALING = 29, 40, 16, 4, 2.0


def _leaves(with_bias: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    gate = torch.randn(ROWS, INTERMEDIATE, generator=generator).requires_grad_()
    up = torch.randn(ROWS, INTERMEDIATE, generator=generator).requires_grad_()
    weight = torch.randn(HIDDEN, INTERMEDIATE, generator=generator)
    bias = torch.randn(HIDDEN, generator=generator) if with_bias else None
    lora_a = torch.randn(RANK, INTERMEDIATE, generator=generator).requires_grad_()
    lora_b = torch.randn(HIDDEN, RANK, generator=generator).requires_grad_()
    upstream = torch.randn(ROWS, HIDDEN, generator=generator)
    return gate, up, weight, bias, lora_a, lora_b, upstream  # type: ignore[return-value]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_output_and_gradients_equal_autograd_of_the_plain_expression(
    activation: str, with_bias: bool
) -> None:
    act = (lambda t: F.silu(t)) if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))

    def run(kind: str) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        gate, up, weight, bias, lora_a, lora_b, upstream = _leaves(with_bias)
        if kind == "ours":
            out = gated_down(gate, up, activation, weight, bias, lora_a, lora_b, SCALING)  # type: ignore[arg-type]
        else:
            hidden = act(gate) * up
            out = F.linear(hidden, weight, bias) + SCALING * (hidden @ lora_a.t()) @ lora_b.t()
        (out * upstream).sum().backward()
        return out.detach(), [gate.grad, up.grad, lora_a.grad, lora_b.grad]

    ours, our_grads = run("ours")
    theirs, their_grads = run("plain")
    assert_close(ours, theirs, dtype=torch.float32, length=INTERMEDIATE + RANK, depth=2)
    for index, (mine, reference) in enumerate(zip(our_grads, their_grads, strict=True)):
        assert mine is not None and reference is not None and mine.shape == reference.shape, index
        assert mine.abs().max() > 0, index
        assert_close(mine, reference, dtype=torch.float32, length=ROWS + HIDDEN + INTERMEDIATE, depth=3)


def test_backward_keeps_gate_and_up_not_the_activation_or_the_product() -> None:
    gate, up, weight, _, lora_a, lora_b, _ = _leaves(with_bias=False)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = F.silu(gate) * up
        F.linear(hidden, weight) + SCALING * (hidden @ lora_a.t()) @ lora_b.t()
    wide = sum(t.numel() for t in saved if t.shape == (ROWS, INTERMEDIATE))
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gated_down(gate, up, "silu", weight, None, lora_a, lora_b, SCALING)
    ours = {t.data_ptr() for t in saved if t.shape == (ROWS, INTERMEDIATE)}
    assert ours == {gate.data_ptr(), up.data_ptr()}
    assert wide > 2 * ROWS * INTERMEDIATE  # autograd's composition keeps more of that width


def test_no_gradients_same_forward_and_a_trainable_base_is_refused() -> None:
    gate, up, weight, bias, lora_a, lora_b, _ = _leaves(with_bias=True)
    with torch.no_grad():
        out = gated_down(gate, up, "silu", weight, bias, lora_a, lora_b, SCALING)
        hidden = F.silu(gate) * up
        expected = F.linear(hidden, weight, bias) + SCALING * (hidden @ lora_a.t()) @ lora_b.t()
    assert not out.requires_grad
    assert_close(out, expected, dtype=torch.float32, length=INTERMEDIATE + RANK, depth=2)
    with pytest.raises(ValueError, match="frozen"):
        gated_down(gate, up, "silu", weight.requires_grad_(), None, lora_a, lora_b, SCALING)


def test_activation_of_names_only_the_activations_it_differentiates() -> None:
    assert activation_of(ACT2FN["silu"]) == "silu"
    assert activation_of(torch.nn.SiLU()) == "silu"
    assert activation_of(ACT2FN["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert activation_of(ACT2FN["gelu"]) is None
    assert activation_of(ACT2FN["relu"]) is None
    hooked = torch.nn.SiLU()
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert activation_of(hooked) is None


def test_the_packed_forward_runs_the_mlp_through_gated_down(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8))
    calls: list[str] = []
    original = packed_forward.gated_down

    def counting(*args: object) -> torch.Tensor:
        calls.append(str(args[2]))
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(packed_forward, "gated_down", counting)
    base: Any = model.get_base_model()
    mlp = base.model.layers[0].mlp
    x = torch.randn(7, tiny_model.model.config.hidden_size, requires_grad=True)
    packed_forward._mlp(mlp, x).sum().backward()
    assert calls == ["silu"]
