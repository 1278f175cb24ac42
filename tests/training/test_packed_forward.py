"""`packed_hidden_states` against transformers' own forward: same hidden states, same LoRA gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from art_core.models.loading import LoadedModel
from art_core.training.config import LoRAConfig
from art_core.training.forward import fused_lora
from art_core.training.lora import attach_lora
from art_core.training.packed_forward import (
    grouped_attention,
    packed_hidden_states,
    project,
    supports_packed_forward,
)
from tests.helpers_models import tiny_gemma3, tiny_llama, tiny_mistral, tiny_qwen3
from tests.tolerances import assert_close, assert_close_to_model

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    peft_model = attach_lora(copy.deepcopy(model), LoRAConfig(r=4, alpha=8))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def batch(prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """3 rows sharing `prefix` tokens, right-padded to 11 tokens; positions: every real token."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 250, (3, 11), generator=generator)
    ids[:, :prefix] = ids[0, :prefix]
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 10:] = 0
    ids[mask == 0] = 0
    return ids, mask, mask > 0


def hidden_and_grads(model: torch.nn.Module, packed: bool, prefix: int) -> tuple[Tensor, list[Tensor]]:
    ids, mask, positions = batch(prefix)
    decoder = model.get_base_model().get_decoder()  # type: ignore[operator]
    model.zero_grad(set_to_none=True)
    with fused_lora(model, "default"):
        if packed:
            hidden = packed_hidden_states(decoder, ids, mask, positions, prefix)
        else:
            out = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden = out[positions]
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3))
    (hidden * weights).sum().backward()
    grads = [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
    return hidden.detach(), grads


@pytest.mark.parametrize("prefix", [0, 5])
@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral", "qwen3", "gemma3"])
def test_packed_forward_equals_transformers(tiny_model: LoadedModel, family: str, prefix: int) -> None:
    base = {
        "qwen2": lambda: tiny_model.model,
        "llama": tiny_llama,
        "mistral": tiny_mistral,
        "qwen3": tiny_qwen3,
        "gemma3": lambda: tiny_gemma3(layers=4, window=4),  # 11-token rows: the window truncates
    }[family]()
    model = with_lora(base)
    assert supports_packed_forward(model.get_base_model().get_decoder())
    ours, our_grads = hidden_and_grads(model, True, prefix)
    theirs, their_grads = hidden_and_grads(model, False, prefix)
    assert ours.shape == theirs.shape == (11 + 8 + 10, model.config.hidden_size)
    assert_close_to_model(ours, theirs, model, torch.float32)
    assert len(our_grads) == len(their_grads) > 0
    for a, b in zip(our_grads, their_grads, strict=True):  # float32 sums in another order
        assert_close_to_model(a, b, model, torch.float32, backward=True)


def test_packed_forward_with_the_adapter_disabled_is_the_base_model(tiny_model: LoadedModel) -> None:
    model = with_lora(tiny_model.model)
    ids, mask, positions = batch(4)
    with torch.no_grad(), model.disable_adapter():  # type: ignore[operator]
        ours = packed_hidden_states(model.get_base_model().get_decoder(), ids, mask, positions, 4)  # type: ignore[operator]
        base = tiny_model.model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[positions]
    assert_close_to_model(ours, base, tiny_model.model, torch.float32)


def test_project_shares_one_down_projection_and_equals_the_layers(tiny_model: LoadedModel) -> None:
    model = with_lora(tiny_model.model)
    attn = model.get_base_model().model.layers[0].self_attn  # type: ignore[operator]
    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(7, tiny_model.model.config.hidden_size)
    calls: list[str] = []
    with torch.no_grad():
        expected = [linear(x) for linear in linears]
        for linear in linears:  # the separate down-projections must not run
            linear.lora_A["default"].register_forward_hook(lambda *args: calls.append("A"))
        ours = project(x, linears)
        assert calls == []
        with model.disable_adapter():  # type: ignore[operator]
            base = project(x, linears)
    for a, b in zip(ours, expected, strict=True):  # one linear: the hidden size, then the rank
        assert_close(a, b, dtype=torch.float32, length=tiny_model.model.config.hidden_size, depth=2)
    for a, linear in zip(base, linears, strict=True):
        torch.testing.assert_close(a, linear.base_layer(x), rtol=0, atol=0)


def test_grouped_attention_equals_sdpa_with_repeated_keys() -> None:
    torch.manual_seed(4)
    batch_size, heads, kv_heads, queries, keys, dim = 2, 6, 2, 5, 9, 8
    q = torch.randn(batch_size, heads, queries, dim)
    k = torch.randn(batch_size, kv_heads, keys, dim)
    v = torch.randn(batch_size, kv_heads, keys, dim)
    allowed = torch.rand(batch_size, 1, queries, keys) > 0.3
    allowed[..., 0] = True
    group = heads // kv_heads
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    stacked = bias[:, :, None].expand(batch_size, kv_heads, group, queries, keys)
    ours = grouped_attention(q, k, v, stacked.reshape(batch_size * kv_heads, group * queries, keys), 0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=allowed, scale=0.3
    )
    assert_close(ours, expected, dtype=torch.float32, length=keys, depth=2)  # q.k, then weights.v


def test_unsupported_decoders_are_refused(tiny_model: LoadedModel) -> None:
    from transformers import Qwen2Config, Qwen2Model

    assert supports_packed_forward(tiny_model.model.get_decoder())
    assert not supports_packed_forward(torch.nn.Linear(2, 2))
    dropout = Qwen2Config(**{**tiny_model.model.config.to_dict(), "attention_dropout": 0.1})
    assert not supports_packed_forward(Qwen2Model(dropout))
    layers = tiny_model.model.config.num_hidden_layers
    kinds = ["full_attention"] * (layers - 1) + ["sliding_attention"]
    sliding = Qwen2Config(**{**tiny_model.model.config.to_dict(), "sliding_window": 4, "layer_types": kinds})
    assert not supports_packed_forward(Qwen2Model(sliding))
