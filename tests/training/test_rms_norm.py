"""`rms_norm`: transformers' RMSNorm with a frozen weight as one autograd node, same values and
input gradients as the module's own ops."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from art_core.training.rms_norm import rms_norm
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_input_gradients_equal_the_modules(norm_class: type, dtype: torch.dtype) -> None:
    hidden = 48
    generator = torch.Generator().manual_seed(0)
    norm = norm_class(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=generator) + 0.5)
    norm.weight.requires_grad_(False)  # frozen, as under LoRA
    x = (torch.randn(2, 7, hidden, generator=generator) * 3).to(dtype).requires_grad_()
    upstream = torch.randn(2, 7, hidden, generator=generator).to(dtype)

    ours = rms_norm(norm, x)
    (our_grad,) = torch.autograd.grad((ours * upstream).sum(), [x])
    theirs = norm(x)
    (their_grad,) = torch.autograd.grad((theirs * upstream).sum(), [x])
    assert ours.grad_fn is not None and type(ours.grad_fn).__name__ == "_FrozenRMSNormBackward"
    assert ours.dtype == theirs.dtype == dtype and our_grad.dtype == dtype
    assert_close(ours, theirs, dtype=dtype, length=hidden, depth=2)
    assert_close(our_grad, their_grad, dtype=dtype, length=hidden, depth=3)
    # and a wrong gradient (the weight left out) is far from it: the comparison can tell
    assert (
        our_grad - torch.autograd.grad((norm(x) * upstream / norm.weight).sum(), [x])[0]
    ).abs().max() > 0.05


def test_a_trainable_weight_or_no_recording_runs_the_module_itself() -> None:
    norm = LlamaRMSNorm(8)
    x = torch.randn(3, 8, requires_grad=True)
    out = rms_norm(norm, x)  # the weight needs a gradient: the module's own ops give it one
    out.sum().backward()
    assert norm.weight.grad is not None
    assert type(out.grad_fn).__name__ != "_FrozenRMSNormBackward"
    norm.weight.requires_grad_(False)
    with torch.no_grad():
        assert rms_norm(norm, x).grad_fn is None
