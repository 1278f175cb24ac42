"""`lora_projections`: several LoRA projections of one input as one autograd node give autograd's
values and gradients of `x W_i^T + b_i + s_i (x A_i^T) B_i^T`, and the packed forward uses it."""

from __future__ import annotations

import pytest
import torch

from art_core.training.lora_projections import lora_projections
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

ROWS, INPUTS = 37, 24
SHAPES = [(40, 4, 2.0), (12, 4, 2.0), (12, 8, 0.5)]
"""(outputs, rank, scaling) of each projection: q/k/v-like, the last with another rank and scaling."""


Leaves = tuple[
    torch.Tensor,
    list[torch.Tensor],
    list[torch.Tensor | None],
    list[torch.Tensor],
    list[torch.Tensor],
    list[torch.Tensor],
]


def _leaves(with_bias: bool, x_grad: bool = True) -> Leaves:
    """x, base weights, biases, LoRA A and B weights, and an upstream gradient per output."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, INPUTS, generator=generator).requires_grad_(x_grad)
    weights = [torch.randn(out, INPUTS, generator=generator) for out, _, _ in SHAPES]
    biases = [torch.randn(out, generator=generator) if with_bias else None for out, _, _ in SHAPES]
    lora_as = [torch.randn(rank, INPUTS, generator=generator).requires_grad_() for _, rank, _ in SHAPES]
    lora_bs = [torch.randn(out, rank, generator=generator).requires_grad_() for out, rank, _ in SHAPES]
    upstream = [torch.randn(ROWS, out, generator=generator) for out, _, _ in SHAPES]
    return x, weights, biases, lora_as, lora_bs, upstream


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
def test_outputs_and_gradients_equal_autograd_of_the_plain_expression(with_bias: bool, x_grad: bool) -> None:
    scalings = [scaling for _, _, scaling in SHAPES]

    def run(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        x, weights, biases, lora_as, lora_bs, upstream = _leaves(with_bias, x_grad)
        if kind == "ours":
            outs = lora_projections(x, torch.cat(lora_as), weights, biases, lora_bs, scalings)
        else:
            outs = [
                torch.nn.functional.linear(x, w, b) + s * (x @ a.t()) @ up.t()
                for w, b, a, up, s in zip(weights, biases, lora_as, lora_bs, scalings, strict=True)
            ]
        sum((out * g).sum() for out, g in zip(outs, upstream, strict=True)).backward()  # type: ignore[union-attr]
        return [out.detach() for out in outs], [
            x.grad,
            *(a.grad for a in lora_as),
            *(b.grad for b in lora_bs),
        ]

    ours, our_grads = run("ours")
    theirs, their_grads = run("plain")
    for mine, reference in zip(ours, theirs, strict=True):
        assert_close(mine, reference, dtype=torch.float32, length=INPUTS + 8, depth=2)
    assert (our_grads[0] is None) == (not x_grad)
    for index, (mine, reference) in enumerate(zip(our_grads, their_grads, strict=True)):
        if reference is None:
            assert mine is None, index
            continue
        assert mine is not None and mine.shape == reference.shape, index
        assert mine.abs().max() > 0, index
        assert_close(mine, reference, dtype=torch.float32, length=ROWS + 40 + INPUTS, depth=3)


def test_without_gradients_it_is_the_same_forward() -> None:
    x, weights, biases, lora_as, lora_bs, _ = _leaves(with_bias=True)
    scalings = [scaling for _, _, scaling in SHAPES]
    with torch.no_grad():
        outs = lora_projections(x, torch.cat(lora_as), weights, biases, lora_bs, scalings)
        expected = [
            torch.nn.functional.linear(x, w, b) + s * (x @ a.t()) @ up.t()
            for w, b, a, up, s in zip(weights, biases, lora_as, lora_bs, scalings, strict=True)
        ]
    for out, want in zip(outs, expected, strict=True):
        assert not out.requires_grad
        assert_close(out, want, dtype=torch.float32, length=INPUTS + 8, depth=2)


def test_trainable_base_weights_and_mismatched_ranks_are_refused() -> None:
    x, weights, biases, lora_as, lora_bs, _ = _leaves(with_bias=False)
    scalings = [scaling for _, _, scaling in SHAPES]
    with pytest.raises(ValueError, match="frozen"):
        lora_projections(
            x, torch.cat(lora_as), [weights[0].requires_grad_()], [None], lora_bs[:1], scalings[:1]
        )
    with pytest.raises(ValueError, match="ranks"):
        lora_projections(x, torch.cat(lora_as), weights[1:], biases[1:], lora_bs[1:], scalings[1:])


@pytest.mark.parametrize("x_grad", [True, False])
def test_with_a_norm_it_equals_the_norm_then_the_projections_and_keeps_x_not_the_normed_values(
    x_grad: bool,
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    scalings = [scaling for _, _, scaling in SHAPES]
    norm = LlamaRMSNorm(INPUTS, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(INPUTS, generator=torch.Generator().manual_seed(5)) + 0.5)
    norm.weight.requires_grad_(False)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    def run(fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        x, weights, biases, lora_as, lora_bs, upstream = _leaves(True, x_grad)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fused:
                outs = lora_projections(
                    x, torch.cat(lora_as), weights, biases, lora_bs, scalings, norm=(norm.weight, 1e-5)
                )
            else:
                outs = lora_projections(norm(x), torch.cat(lora_as), weights, biases, lora_bs, scalings)
        sum((out * g).sum() for out, g in zip(outs, upstream, strict=True)).backward()  # type: ignore[union-attr]
        return [out.detach() for out in outs], [
            x.grad,
            *(a.grad for a in lora_as),
            *(b.grad for b in lora_bs),
        ]

    ours, our_grads = run(fused=True)
    kept = [t for t in saved if t.shape == (ROWS, INPUTS)]
    saved.clear()
    theirs, their_grads = run(fused=False)
    for mine, reference in zip(ours, theirs, strict=True):
        assert_close(mine, reference, dtype=torch.float32, length=2 * INPUTS + 8, depth=3)
    for index, (mine, reference) in enumerate(zip(our_grads, their_grads, strict=True)):
        if reference is None:
            assert mine is None and index == 0 and not x_grad
            continue
        assert mine is not None and mine.abs().max() > 0, index
        assert_close(mine, reference, dtype=torch.float32, length=ROWS + 40 + 2 * INPUTS, depth=4)
    assert len(kept) == 1  # x itself: the normed [ROWS, INPUTS] values are recomputed in backward
