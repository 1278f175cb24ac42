"""A gated MLP's second half, `down(act(gate) * up)` with a LoRA `down`, as one autograd node.

Composed of torch ops, autograd keeps for the backward pass the activation `act(gate)` (to
differentiate the product) and the product `h = act(gate) * up` (the input of the down
projection's LoRA A), beside `gate` and `up` themselves: four [N, intermediate] tensors a layer.
For SmolLM2-135M in float32 that is 24 KB a token a layer, half of everything a train step keeps
per token (docs/benchmarks.md, "whole groups in one pass": ~1.4 MB a token in all). `gated_down`
keeps `gate` and `up` only and recomputes `act(gate)` and the product in backward (two elementwise
passes over [N, intermediate], next to the layer's three matmuls), so a pass over the same tokens
needs a quarter less memory, and more of a step's groups fit in one pass.

Forward: `out = h W^T + b + s (h A^T) B^T` with the update added in place on the base matmul's
output (as `lora_update.add_lora_update_`). Backward, for the output's gradient `g`:
`grad_B = s g^T (h A^T)`, `grad_down = s g B`, `grad_A = grad_down^T h`, `grad_h = g W + grad_down A`,
then `grad_up = grad_h act(gate)` and `grad_gate = act'(gate) grad_h up` through torch's own
activation backward kernels (`silu_backward`, `gelu_backward`), so the values are autograd's up to
the order of the sums (tests/training/test_gated_mlp.py).

Activations: SiLU (Llama, Qwen, SmolLM) and the tanh GELU (Gemma); the base weight must be frozen.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import GELUTanh, SiLUActivation

from art_core.training.lora_update import lora_down_grad, lora_up_grad

Activation = Literal["silu", "gelu_tanh"]


def activation_of(module: Any) -> Activation | None:
    """Which activation `module` (an MLP's `act_fn`) computes, when `gated_down` has its backward;
    None for anything else (another activation, a replaced forward, hooks)."""
    if not isinstance(module, nn.Module) or "forward" in vars(module):
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    if type(module) in (SiLUActivation, nn.SiLU):
        return "silu"
    if type(module) is GELUTanh:
        act = getattr(module, "act", None)
        if (
            isinstance(act, functools.partial)
            and act.func is F.gelu
            and act.keywords == {"approximate": "tanh"}
        ):
            return "gelu_tanh"
    return None


def _act(x: Tensor, activation: Activation) -> Tensor:
    return F.silu(x) if activation == "silu" else F.gelu(x, approximate="tanh")


def _act_backward(grad: Tensor, x: Tensor, activation: Activation) -> Tensor:
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, x)  # type: ignore[no-any-return]
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")  # type: ignore[no-any-return]


def _forward(
    gate: Tensor,
    up: Tensor,
    activation: Activation,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """(output, `h A^T`)."""
    hidden = _act(gate, activation).mul_(up)
    down = F.linear(hidden, lora_a)
    out = F.linear(hidden, weight, bias)
    return out.addmm_(down, lora_b.t(), alpha=scaling), down


class _GatedDown(torch.autograd.Function):
    """See the module docstring; gradients for `gate`, `up`, `lora_a` and `lora_b`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gate: Tensor,
        up: Tensor,
        lora_a: Tensor,
        lora_b: Tensor,
        activation: Activation,
        weight: Tensor,
        bias: Tensor | None,
        scaling: float,
    ) -> Tensor:
        out, down = _forward(gate, up, activation, weight, bias, lora_a, lora_b, scaling)
        ctx.save_for_backward(gate, up, lora_a, lora_b, down)
        ctx.activation, ctx.weight, ctx.scaling = activation, weight, scaling
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gate, up, lora_a, lora_b, down = ctx.saved_tensors
        activation: Activation = ctx.activation
        scaling: float = ctx.scaling
        need_gate, need_up, need_a, need_b = ctx.needs_input_grad[:4]
        grad_b = lora_up_grad(grad, down, scaling) if need_b else None
        grad_down = lora_down_grad(grad, lora_b, scaling)
        activated = _act(gate, activation)
        grad_a = torch.mm(grad_down.t(), activated * up) if need_a else None
        grad_gate = grad_up = None
        if need_gate or need_up:
            grad_hidden = torch.mm(grad, ctx.weight).addmm_(grad_down, lora_a)
            if need_up:
                grad_up = grad_hidden * activated
            if need_gate:
                grad_gate = _act_backward(grad_hidden.mul_(up), gate, activation)
        return grad_gate, grad_up, grad_a, grad_b, None, None, None, None


def gated_down(
    gate: Tensor,
    up: Tensor,
    activation: Activation,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float,
) -> Tensor:
    """`down(act(gate) * up)` for [N, intermediate] `gate` and `up`, the down projection's frozen
    [hidden, intermediate] `weight` and `bias`, its LoRA A [r, intermediate] and B [hidden, r]
    weights and scaling, all in `gate`'s dtype; keeps only `gate` and `up` (and [N, r]) for backward."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("gated_down computes no gradient for the base weight: it must be frozen")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (gate, up, lora_a, lora_b)):
        return _GatedDown.apply(gate, up, lora_a, lora_b, activation, weight, bias, scaling)  # type: ignore[no-any-return]
    return _forward(gate, up, activation, weight, bias, lora_a, lora_b, scaling)[0]
