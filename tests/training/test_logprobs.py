"""Chunked log-probs against the naive full log_softmax + gather."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from art_core.training.logprobs import IGNORE_INDEX, sequence_targets, token_logprobs
from tests.tolerances import assert_close

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

B, T, H, V = 3, 5, 8, 11


def naive(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor) -> tuple[Tensor, Tensor]:
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def make(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, torch.nn.Linear, Tensor]:
    torch.manual_seed(seed)
    hidden = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=True).to(dtype)
    targets = torch.randint(0, V, (B, T))
    return hidden, head, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 7, B * T, 64])
def test_matches_naive_in_value_and_gradient(chunk_size: int) -> None:
    hidden, head, targets = make()
    upstream = torch.randn(B, T)
    logprobs, entropy = token_logprobs(hidden, head, targets, chunk_size=chunk_size, with_entropy=True)
    grads = torch.autograd.grad((logprobs * upstream).sum(), [hidden, head.weight, head.bias])

    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [hidden, head.weight, head.bias])
    torch.testing.assert_close(logprobs, expected)
    assert entropy is not None and not entropy.requires_grad
    torch.testing.assert_close(entropy, expected_entropy.detach())
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_raw_weight_and_frozen_head() -> None:
    hidden, head, targets = make(1)
    weight = head.weight.detach().clone().requires_grad_(True)
    logprobs, entropy = token_logprobs(hidden, weight, targets, chunk_size=4)
    assert entropy is None
    grad_h, grad_w = torch.autograd.grad(logprobs.sum(), [hidden, weight])
    expected, _ = naive(hidden, weight, None, targets)
    want_h, want_w = torch.autograd.grad(expected.sum(), [hidden, weight])
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(grad_h, want_h)
    torch.testing.assert_close(grad_w, want_w)

    frozen = weight.detach()
    (grad_only_h,) = torch.autograd.grad(token_logprobs(hidden, frozen, targets, 4)[0].sum(), [hidden])
    torch.testing.assert_close(grad_only_h, want_h)


@pytest.mark.parametrize("chunk_size", [1, 4, 9, B * T])
@pytest.mark.parametrize(
    "vocab_block", [1, 3, 4, V, 4096]
)  # the vocabulary in 11, 4 (3 + a partial), 3, 1 block(s)
def test_frozen_head_entropy_matches_naive_and_keeps_gradients(chunk_size: int, vocab_block: int) -> None:
    hidden, head, targets = make(2)
    head.requires_grad_(False)
    upstream = torch.randn(B, T)
    logprobs, entropy = token_logprobs(
        hidden, head, targets, chunk_size=chunk_size, with_entropy=True, vocab_block=vocab_block
    )
    (grad,) = torch.autograd.grad((logprobs * upstream).sum(), [hidden])
    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    (want,) = torch.autograd.grad((expected * upstream).sum(), [hidden])
    assert entropy is not None and entropy.shape == (B, T) and not entropy.requires_grad
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(grad, want)  # the in-place probabilities still give E_p[W]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("grad", [True, False])
def test_frozen_head_entropy_with_and_without_gradients(with_bias: bool, grad: bool) -> None:
    """With a gradient to make, a float32 head's entropy comes from E_p[W] (log Z - h . E_p[W] -
    E_p[b]); without one, from the running sum of p (z - m). Both equal the naive entropy."""
    hidden, head, targets = make(4)
    head.requires_grad_(False)
    if not with_bias:
        head.bias = None
    with torch.set_grad_enabled(grad):
        logprobs, entropy = token_logprobs(
            hidden, head, targets, chunk_size=4, with_entropy=True, vocab_block=3
        )
    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    assert entropy is not None and logprobs.requires_grad == grad
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(logprobs.detach(), expected.detach())


def test_frozen_head_blocks_stay_exact_for_large_logits_whose_maximum_is_in_a_late_block() -> None:
    """Logits in the hundreds (exp overflows float32 past ~88) whose largest values lie in the last
    vocabulary blocks: every earlier block's running sums are rescaled, and nothing overflows."""
    hidden, head, targets = make(6)
    head.requires_grad_(False)
    with torch.no_grad():
        head.weight.mul_(torch.linspace(1, 3, V)[:, None])  # later rows, larger logits
        hidden.mul_(60)
    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    assert expected.min() < -100  # far outside exp's float32 range without the running maximum
    logprobs, entropy = token_logprobs(hidden, head, targets, chunk_size=4, with_entropy=True, vocab_block=2)
    (grad,) = torch.autograd.grad(logprobs.sum(), [hidden])
    (want,) = torch.autograd.grad(expected.sum(), [hidden])
    assert entropy is not None and torch.isfinite(entropy).all() and torch.isfinite(grad).all()
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=64 * torch.finfo(torch.float32).eps * scale)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=0, atol=1e-3)
    torch.testing.assert_close(grad, want)


def test_any_module_head_gets_gradients() -> None:
    """A head that is not an nn.Linear (e.g. LoRA-wrapped) is called as a module; its parameters get grads."""
    hidden, head, targets = make(2)
    wrapped = torch.nn.Sequential(head)
    logprobs, _ = token_logprobs(hidden, wrapped, targets, chunk_size=2)
    (grad_w,) = torch.autograd.grad(logprobs.sum(), [head.weight])
    expected, _ = naive(hidden, head.weight, head.bias, targets)
    (want_w,) = torch.autograd.grad(expected.sum(), [head.weight])
    torch.testing.assert_close(grad_w, want_w)


@pytest.mark.parametrize("frozen", [False, True])
def test_bf16_input_gives_float32_output(frozen: bool) -> None:
    hidden, head, targets = make(3, torch.bfloat16)
    head.requires_grad_(not frozen)
    logprobs, entropy = token_logprobs(hidden, head, targets, chunk_size=4, with_entropy=True, vocab_block=3)
    assert logprobs.dtype == torch.float32 and entropy is not None and entropy.dtype == torch.float32
    expected, expected_entropy = naive(hidden, head.weight, head.bias, targets)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, expected_entropy.detach())
    (grad,) = torch.autograd.grad(logprobs.sum(), [hidden])
    (want,) = torch.autograd.grad(expected.sum(), [hidden])
    assert grad.dtype == torch.bfloat16
    # the frozen head's gradient is W[t] - E_p[W] in float32, rounded to bf16 once; autograd's runs
    # a bf16 matmul: the two differ by bf16 rounding over the vocabulary's sum
    assert_close(grad, want, dtype=torch.bfloat16, length=V, depth=2)


def test_no_grad_mode_and_ignored_targets() -> None:
    hidden, head, targets = make(4)
    targets[:, -1] = IGNORE_INDEX
    with torch.no_grad():
        logprobs, _ = token_logprobs(hidden, head, targets, chunk_size=4)
    assert not logprobs.requires_grad
    assert (logprobs[:, -1] == 0).all()
    expected, _ = naive(hidden, head.weight, head.bias, targets.clamp(min=0))
    torch.testing.assert_close(logprobs[:, :-1], expected[:, :-1])


def test_full_logits_are_never_saved_for_backward() -> None:
    """Forward keeps no vocabulary-sized tensor alive for backward (naive keeps B*T*V of them)."""
    hidden, head, targets = make(5)
    vocab_sized: list[int] = []

    def pack(t: Tensor) -> Tensor:
        if t.dim() >= 2 and t.shape[-1] == V:  # [..., V] logits / log-probs (the weight is [V, H])
            vocab_sized.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        naive(hidden, head.weight, head.bias, targets)
    assert sum(vocab_sized) >= B * T * V  # the probe sees the full logits of the naive version

    vocab_sized.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, head, targets, chunk_size=2)
    assert sum(vocab_sized) < B * T * V


def test_sequence_targets_shift_left() -> None:
    ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
    assert sequence_targets(ids).tolist() == [[6, 7, IGNORE_INDEX], [2, 3, IGNORE_INDEX]]


def test_shape_errors() -> None:
    hidden, head, targets = make()
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, head, targets[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, head, targets, chunk_size=0)


def test_a_target_outside_the_frozen_heads_vocabulary_is_an_error() -> None:
    hidden, head, targets = make(7)
    head.requires_grad_(False)
    targets[0, 0] = V  # one past the vocabulary
    with pytest.raises(ValueError, match="outside the head's vocabulary of 11"):
        token_logprobs(hidden, head, targets)
