"""Policy losses against a float64 per-token reference written as plain loops, plus invariants."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from art_core.training.config import DEFAULT_EPSILONS, LossConfig
from art_core.training.loss import LOSSES, LossBatch, compute_loss

NAMES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
# Clip ranges chosen so that, with the noise in `make_case`, some tokens clip on both sides and some don't.
CLIPS = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.15, 0.25),
    "dapo": (0.2, 0.28),
    "gspo": (0.05, 0.08),
    "cispo": (0.2, 0.3),
}
FAST = settings(max_examples=25, deadline=None)


@dataclass
class Case:
    logprobs: Tensor
    old: Tensor
    engine: Tensor
    ref: Tensor
    adv: Tensor
    mask: Tensor
    num_sequences: float
    num_tokens: float
    max_len: float


def make_mask(gen: torch.Generator, b: int, t: int, pattern: str) -> Tensor:
    if pattern == "full":
        return torch.ones(b, t)
    if pattern == "random":
        return (torch.rand(b, t, generator=gen) < 0.6).float()
    mask = torch.zeros(b, t)
    for row in range(b):  # "prompt_then_completion": a prompt prefix, a completion, right padding
        start = int(torch.randint(0, t // 2 + 1, (1,), generator=gen))
        stop = int(torch.randint(start + 1, t + 1, (1,), generator=gen))
        mask[row, start:stop] = 1.0
    if pattern == "empty_row":
        mask[b // 2] = 0.0
    return mask


def make_case(seed: int, b: int = 4, t: int = 6, pattern: str = "random", noise: float = 0.3) -> Case:
    """Float64 data with garbage (inf / NaN) at masked positions; some engine log-probs unknown (NaN)."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(gen, b, t, pattern)
    logprobs = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = logprobs + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    engine = old + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    engine[torch.rand(b, t, generator=gen) < 0.25] = float("nan")
    ref = logprobs + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    masked = mask == 0
    logprobs[masked], old[masked], ref[masked] = -math.inf, math.nan, math.inf
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    n_tok = float(mask.sum())
    return Case(logprobs, old, engine, ref, adv, mask, b + 1.0, n_tok + 2.0, float(t) + 1.0)


def clip(x: float, low: float, high: float) -> float:
    return low if x < low else high if x > high else x


def reference_loss(
    name: str, lp: Tensor, case: Case, eps: float, eps_high: float, kl_coef: float, tis_cap: float | None
) -> Tensor:
    """The loss written token by token in float64; `lp` is a float64 leaf (only its masked-in entries used)."""
    total = torch.zeros((), dtype=torch.float64)
    values = lp.detach()
    for b in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if case.mask[b, t] > 0]
        a = float(case.adv[b])
        if tokens:
            seq_log_ratio = sum(float(values[b, t]) - float(case.old[b, t]) for t in tokens) / len(tokens)
        row = torch.zeros((), dtype=torch.float64)
        for t in tokens:
            term: Tensor | float
            old, engine = float(case.old[b, t]), float(case.engine[b, t])
            w = 1.0 if tis_cap is None or math.isnan(engine) else min(math.exp(old - engine), tis_cap)
            if name == "cispo":
                term = -clip(math.exp(float(values[b, t]) - old), 1 - eps, 1 + eps_high) * a * lp[b, t]
            else:
                if name == "gspo":
                    r = math.exp(seq_log_ratio) * torch.exp(lp[b, t] - float(values[b, t]))
                else:
                    r = torch.exp(lp[b, t] - old)
                rf = float(r.detach())
                r_clipped = r if 1 - eps <= rf <= 1 + eps_high else clip(rf, 1 - eps, 1 + eps_high)
                term = -min(r * a, r_clipped * a)
            delta = float(case.ref[b, t]) - lp[b, t]
            row = row + term * w + kl_coef * (torch.exp(delta) - delta - 1)
        if name in ("grpo", "gspo"):
            total = total + (row / len(tokens) if tokens else row)
        else:
            total = total + row
    if name in ("grpo", "gspo"):
        return total / case.num_sequences
    if name == "dr_grpo":
        return total / (case.num_sequences * case.max_len)
    return total / case.num_tokens


def batch_of(
    case: Case, logprobs: Tensor, dtype: torch.dtype = torch.float64, **changes: object
) -> LossBatch:
    fields: dict[str, object] = dict(
        logprobs=logprobs,
        old_logprobs=case.old.to(dtype),
        engine_logprobs=case.engine.to(dtype),
        advantages=case.adv.to(dtype),
        mask=case.mask.to(dtype),
        num_sequences=case.num_sequences,
        num_tokens=case.num_tokens,
        max_completion_tokens=case.max_len,
        ref_logprobs=case.ref.to(dtype),
    )
    fields.update(changes)
    return LossBatch(**fields)  # type: ignore[arg-type]


def loss_and_grad(batch: LossBatch, config: LossConfig) -> tuple[Tensor, Tensor]:
    out = compute_loss(batch, config)
    (grad,) = torch.autograd.grad(out.loss, batch.logprobs)
    return out.loss.detach(), grad


def leaf(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    return x.detach().to(dtype).clone().requires_grad_(True)


def rounded(case: Case, dtype: torch.dtype) -> Case:
    """The case as the implementation sees it in `dtype`, back in float64 for the reference."""

    def r(x: Tensor) -> Tensor:
        return x.to(dtype).to(torch.float64)

    return Case(
        r(case.logprobs),
        r(case.old),
        r(case.engine),
        r(case.ref),
        r(case.adv),
        case.mask,
        case.num_sequences,
        case.num_tokens,
        case.max_len,
    )


TOL = {
    torch.float64: (1e-10, 1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5, 1e-6),
    torch.bfloat16: (1e-4, 2e-2, 2e-3),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", ["full", "random", "prompt_then_completion", "empty_row"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kl_coef,tis_cap", [(0.0, None), (0.3, 1.5)])
def test_matches_float64_reference(
    name: str, pattern: str, dtype: torch.dtype, kl_coef: float, tis_cap: float | None
) -> None:
    case = rounded(make_case(seed=len(pattern) * 7 + NAMES.index(name), pattern=pattern), dtype)
    eps, eps_high = CLIPS[name]
    config = LossConfig(name=name, epsilon=eps, epsilon_high=eps_high, kl_coef=kl_coef, tis_cap=tis_cap)
    lp = leaf(case.logprobs, dtype)
    loss, grad = loss_and_grad(batch_of(case, lp, dtype), config)

    ref_lp = leaf(case.logprobs)
    expected = reference_loss(name, ref_lp, case, eps, eps_high, kl_coef, tis_cap)
    (expected_grad,) = torch.autograd.grad(expected, ref_lp, allow_unused=True)
    loss_tol, grad_rtol, grad_atol = TOL[dtype]
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=loss_tol, atol=loss_tol)
    assert torch.isfinite(grad).all()
    assert (grad[case.mask == 0] == 0).all()
    torch.testing.assert_close(grad.double(), expected_grad, rtol=grad_rtol, atol=grad_atol)


def test_reference_case_exercises_clipping() -> None:
    """Guard on the data above: the reference test is only meaningful if clipping happens sometimes, not always."""
    for name in NAMES:
        case = make_case(seed=3, pattern="full")
        eps, eps_high = CLIPS[name]
        out = compute_loss(batch_of(case, leaf(case.logprobs)), LossConfig(name, eps, eps_high, tis_cap=None))
        assert 0.0 < float(out.metrics["clip_fraction"]) < 1.0, name


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES), tis=st.sampled_from([None, 2.0]))
@FAST
def test_zero_advantage_gives_zero_gradient(seed: int, name: str, tis: float | None) -> None:
    case = make_case(seed)
    case.adv = torch.zeros_like(case.adv)
    loss, grad = loss_and_grad(batch_of(case, leaf(case.logprobs)), LossConfig(name, tis_cap=tis))
    assert float(loss) == 0.0
    assert (grad == 0).all()


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES), extra=st.integers(1, 5))
@FAST
def test_padding_columns_change_nothing(seed: int, name: str, extra: int) -> None:
    case = make_case(seed)
    config = LossConfig(name, *CLIPS[name], kl_coef=0.2)
    loss, grad = loss_and_grad(batch_of(case, leaf(case.logprobs)), config)

    b = case.mask.shape[0]

    def pad(x: Tensor, value: float) -> Tensor:
        return torch.cat([x, torch.full((b, extra), value, dtype=x.dtype)], dim=1)

    padded = Case(
        pad(case.logprobs, -math.inf),
        pad(case.old, math.nan),
        pad(case.engine, 5.0),
        pad(case.ref, math.nan),
        case.adv,
        pad(case.mask, 0.0),
        case.num_sequences,
        case.num_tokens,
        case.max_len,
    )
    padded_loss, padded_grad = loss_and_grad(batch_of(padded, leaf(padded.logprobs)), config)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(padded_grad[:, : case.mask.shape[1]], grad, rtol=1e-12, atol=1e-12)
    assert (padded_grad[:, case.mask.shape[1] :] == 0).all()


def reduce_like(name: str, x: Tensor, case: Case) -> Tensor:
    """The loss's reduction of a per-token quantity, written out with tensor ops."""
    m = case.mask
    x = torch.where(m > 0, x, torch.zeros_like(x))
    if name in ("grpo", "gspo"):
        return (x.sum(1) / m.sum(1).clamp(min=1)).sum() / case.num_sequences
    if name == "dr_grpo":
        return x.sum() / (case.num_sequences * case.max_len)
    return x.sum() / case.num_tokens


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES))
@FAST
def test_ratio_one_is_reinforce(seed: int, name: str) -> None:
    """old == new, no TIS, no KL: the gradient is REINFORCE's; so is the value for cispo (PPO forms give -A)."""
    case = make_case(seed)
    lp = leaf(case.logprobs)
    batch = batch_of(case, lp, old_logprobs=lp.detach())
    loss, grad = loss_and_grad(batch, LossConfig(name, tis_cap=None))

    ref_lp = leaf(case.logprobs)
    reinforce = reduce_like(name, -case.adv[:, None] * ref_lp, case)
    (expected_grad,) = torch.autograd.grad(reinforce, ref_lp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    surrogate_value = (
        reinforce if name == "cispo" else reduce_like(name, -case.adv[:, None].expand_as(lp), case)
    )
    torch.testing.assert_close(loss, surrogate_value.detach(), rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES), split=st.integers(1, 3))
@FAST
def test_two_half_batches_accumulate_to_one_batch(seed: int, name: str, split: int) -> None:
    case = make_case(seed, b=4)
    config = LossConfig(name, *CLIPS[name], kl_coef=0.1, tis_cap=1.5)
    loss, grad = loss_and_grad(batch_of(case, leaf(case.logprobs)), config)

    def part(rows: slice) -> Case:
        return Case(
            case.logprobs[rows],
            case.old[rows],
            case.engine[rows],
            case.ref[rows],
            case.adv[rows],
            case.mask[rows],
            case.num_sequences,
            case.num_tokens,
            case.max_len,
        )

    first, second = part(slice(0, split)), part(slice(split, None))
    loss_a, grad_a = loss_and_grad(batch_of(first, leaf(first.logprobs)), config)
    loss_b, grad_b = loss_and_grad(batch_of(second, leaf(second.logprobs)), config)
    torch.testing.assert_close(loss_a + loss_b, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grad_a, grad_b]), grad, rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES))
@FAST
def test_kl_is_zero_when_reference_equals_policy(seed: int, name: str) -> None:
    case = make_case(seed)
    config = LossConfig(name, *CLIPS[name], tis_cap=2.0)
    with_kl = LossConfig(name, *CLIPS[name], tis_cap=2.0, kl_coef=0.5)
    lp = leaf(case.logprobs)
    out = compute_loss(batch_of(case, lp, ref_logprobs=lp.detach()), with_kl)
    assert float(out.metrics["kl"]) == 0.0 and float(out.metrics["kl_loss"]) == 0.0
    loss, grad = loss_and_grad(batch_of(case, lp, ref_logprobs=lp.detach()), with_kl)
    plain_loss, plain_grad = loss_and_grad(batch_of(case, lp), config)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-12, atol=1e-12)


def test_kl_is_positive_and_needs_reference() -> None:
    case = make_case(1)
    out = compute_loss(batch_of(case, leaf(case.logprobs)), LossConfig(kl_coef=0.5))
    assert float(out.metrics["kl"]) > 0
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(batch_of(case, leaf(case.logprobs), ref_logprobs=None), LossConfig(kl_coef=0.5))


@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES), cap=st.floats(0.5, 4.0))
@FAST
def test_tis_weight_is_capped(seed: int, name: str, cap: float) -> None:
    """Engine far less likely than the trainer: every weight hits the cap, so the policy loss scales by it."""
    case = make_case(seed)
    lp = leaf(case.logprobs)
    far = batch_of(case, lp, engine_logprobs=case.old - 10.0)
    out = compute_loss(far, LossConfig(name, *CLIPS[name], tis_cap=cap))
    plain = compute_loss(far, LossConfig(name, *CLIPS[name], tis_cap=None))
    if case.mask.sum() > 0:
        torch.testing.assert_close(out.metrics["tis_weight_mean"], torch.tensor(cap, dtype=torch.float64))
    torch.testing.assert_close(out.loss, cap * plain.loss, rtol=1e-12, atol=1e-12)
    known_engine = batch_of(case, lp, engine_logprobs=case.engine.nan_to_num(nan=-1.0))
    random_engine = compute_loss(known_engine, LossConfig(name, tis_cap=cap))
    assert float(random_engine.metrics["tis_weight_mean"]) <= cap + 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_unknown_engine_logprobs_give_weight_one(name: str) -> None:
    case = make_case(5)
    lp = leaf(case.logprobs)
    batch = batch_of(case, lp, engine_logprobs=torch.full_like(case.old, math.nan))
    out = compute_loss(batch, LossConfig(name, tis_cap=2.0))
    plain = compute_loss(batch, LossConfig(name, tis_cap=None))
    assert float(out.metrics["tis_weight_mean"]) == 1.0
    assert "tis_weight_mean" not in plain.metrics
    torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)


def test_clipping_removes_the_gradient() -> None:
    """grpo, A > 0 and every ratio above 1 + eps: all tokens clipped, no gradient."""
    case = make_case(2, pattern="full")
    case.adv = case.adv.abs() + 0.1
    lp = leaf(case.logprobs)
    out = compute_loss(batch_of(case, lp, old_logprobs=lp.detach() - 1.0), LossConfig("grpo", tis_cap=None))
    assert float(out.metrics["clip_fraction"]) == 1.0
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert (grad == 0).all()


def test_gspo_token_form_has_the_sequence_level_gradient() -> None:
    """Without TIS, GSPO-token's gradient equals that of -min(s*A, clip(s)*A) with s = exp(mean log-ratio)."""
    case = make_case(9, pattern="prompt_then_completion", noise=0.02)
    lp = leaf(case.logprobs)
    config = LossConfig("gspo", epsilon=0.01, epsilon_high=0.01, tis_cap=None)
    loss, grad = loss_and_grad(batch_of(case, lp), config)
    ref_lp = leaf(case.logprobs)
    m = case.mask > 0
    log_ratio = torch.where(m, ref_lp - torch.where(m, case.old, 0.0), 0.0)
    s = torch.exp(log_ratio.sum(1) / m.sum(1).clamp(min=1))
    a = case.adv
    per_seq = -torch.minimum(s * a, s.clamp(0.99, 1.01) * a) * (m.sum(1) > 0)
    expected = per_seq.sum() / case.num_sequences
    (expected_grad,) = torch.autograd.grad(expected, ref_lp)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_default_clip_ranges() -> None:
    assert LossConfig("grpo").clip_range() == (0.2, 0.2)
    assert LossConfig("grpo", epsilon=0.1).clip_range() == (0.1, 0.1)
    assert LossConfig("dr_grpo").clip_range() == (0.2, 0.2)
    assert LossConfig("dapo").clip_range() == (0.2, 0.28)
    assert LossConfig("dapo", epsilon=0.1).clip_range() == (0.1, 0.28)
    assert LossConfig("gspo").clip_range() == (3e-4, 4e-4)
    assert LossConfig("cispo").clip_range() == (1.0, 4.0)
    assert LossConfig("cispo", epsilon_high=2.0).clip_range() == (1.0, 2.0)
    assert sorted(LOSSES) == sorted(NAMES) == sorted(DEFAULT_EPSILONS)  # the torch-free config knows them all


def test_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"unknown loss name 'ppo'.*'cispo'.*'grpo'"):
        LossConfig(name="ppo")
    with pytest.raises(ValueError, match="epsilon"):
        LossConfig(epsilon=-0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=math.nan)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="normalise_over must be 'scored' or 'trained', got 'all'"):
        LossConfig(normalise_over="all")


def test_batch_errors_are_clear() -> None:
    case = make_case(0)
    lp = leaf(case.logprobs)
    with pytest.raises(ValueError, match="advantages"):
        batch_of(case, lp, advantages=case.adv[:2])
    with pytest.raises(ValueError, match="mask"):
        batch_of(case, lp, mask=case.mask[:, :2])
    with pytest.raises(ValueError, match="num_tokens"):
        batch_of(case, lp, num_tokens=0.0)


def test_metrics_are_detached_scalars() -> None:
    case = make_case(4)
    out = compute_loss(batch_of(case, leaf(case.logprobs)), LossConfig("dapo", kl_coef=0.1))
    expected = {"policy_loss", "kl_loss", "kl", "clip_fraction", "ratio_mean", "tis_weight_mean", "tokens"}
    assert set(out.metrics) == expected
    for value in out.metrics.values():
        assert value.shape == () and not value.requires_grad and torch.isfinite(value)
    assert float(out.metrics["tokens"]) == float(case.mask.sum())
    torch.testing.assert_close(out.metrics["policy_loss"] + out.metrics["kl_loss"], out.loss.detach())
