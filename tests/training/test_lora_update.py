"""`add_lora_update_`: the in-place LoRA update with its own backward gives autograd's values and
gradients of `base + scaling * down @ B^T`."""

from __future__ import annotations

import pytest
import torch

from art_core.training.lora_update import add_lora_update_
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_and_its_gradients_equal_autograd_of_the_plain_expression(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, inputs, outputs, rank, scaling = 37, 24, 40, 4, 2.0

    def leaves() -> list[torch.Tensor]:
        generator.manual_seed(0)
        shapes = [(rows, inputs), (outputs, inputs), (3 * rank, inputs), (outputs, rank), (rows, outputs)]
        return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]

    def run(update: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x, weight, lora_a, lora_b, upstream = leaves()
        down = x @ lora_a.t()  # [rows, 3 * rank]: a group's down-projections, sliced per layer
        middle = down[:, rank : 2 * rank]  # a column slice (not contiguous), as `project` passes it
        base = x @ weight.t()
        if update == "ours":
            out = add_lora_update_(base, middle, lora_b, scaling)
        else:
            out = base + scaling * middle @ lora_b.t()
        (out * upstream).sum().backward()
        return out.detach(), [leaf.grad for leaf in (x, weight, lora_a, lora_b)]  # type: ignore[misc]

    ours, our_grads = run("ours")
    theirs, their_grads = run("plain")
    assert_close(ours, theirs, dtype=dtype, length=inputs + rank, depth=2)
    for name, mine, reference in zip(
        ["x", "weight", "lora_A", "lora_B"], our_grads, their_grads, strict=True
    ):
        assert mine is not None and reference is not None, name
        assert mine.shape == reference.shape, name
        assert_close(mine, reference, dtype=dtype, length=rows + outputs, depth=3)
    assert our_grads[3].abs().max() > 0 and our_grads[2][rank : 2 * rank].abs().max() > 0
    assert torch.equal(our_grads[2][:rank], torch.zeros_like(our_grads[2][:rank]))  # other slices untouched


def test_without_gradients_it_is_the_plain_in_place_addmm() -> None:
    generator = torch.Generator().manual_seed(3)
    out, down, up = (torch.randn(shape, generator=generator) for shape in [(5, 6), (5, 2), (6, 2)])
    expected = out + 0.5 * down @ up.t()
    with torch.no_grad():
        result = add_lora_update_(out, down, up, 0.5)
    assert result is out  # in place
    assert_close(result, expected, dtype=torch.float32, length=2)
