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
    TokenTree,
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


def test_packed_forward_gradients_are_the_same_bits_every_pass(tiny_model: LoadedModel) -> None:
    """Positions that read the same packed token (here: every row's copy of a shared prefix) add
    their gradients in the same order every pass. Advanced indexing's backward added them with
    atomic adds on two threads, so seeded runs parted in the last bits from the first step on."""
    model = with_lora(tiny_model.model)
    decoder = model.get_base_model().get_decoder()  # type: ignore[operator]
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 250, (16, 12), generator=generator)
    ids[:, :8] = ids[0, :8]  # 16 rows share 8 tokens: each shared token's state is read 16 times
    mask = torch.ones_like(ids)
    weights = torch.randn(16 * 12, model.config.hidden_size, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the atomic adds need two threads to race
    try:
        passes = []
        for _ in range(12):
            model.zero_grad(set_to_none=True)
            with fused_lora(model, "default"):
                hidden = packed_hidden_states(decoder, ids, mask, mask > 0, 8)
            (hidden * weights).sum().backward()
            passes.append([p.grad.clone() for n, p in model.named_parameters() if "lora_" in n])
    finally:
        torch.set_num_threads(threads)
    assert passes[0]
    for grads in passes[1:]:
        assert all(torch.equal(a, b) for a, b in zip(passes[0], grads, strict=True))


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


def grouped_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """7 rows in 4 groups, right-padded to 13 tokens: a 4-token prefix common to all, then each
    group's own run (3 and 6 tokens, one group whose rows differ at once, one single row), rows of
    unequal lengths, one row whose group run leaves it a single token of its own."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 250, (7, 13), generator=generator)
    groups = torch.tensor([2, 2, 7, 7, 7, 3, 9])
    ids[:, :4] = ids[0, :4]
    ids[1, :7] = ids[0, :7]  # group 2: 3 more tokens
    ids[2:5, :10] = ids[2, :10]  # group 7: 6 more tokens (row 4 ends at 11: one own token)
    mask = torch.ones_like(ids)
    for row, length in enumerate([13, 9, 12, 13, 11, 8, 10]):
        mask[row, length:] = 0
    ids[mask == 0] = 0
    return ids, mask, mask > 0, groups


@pytest.mark.parametrize("prefix", [0, 4])
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_packed_forward_with_group_segments_equals_transformers(
    tiny_model: LoadedModel, family: str, prefix: int
) -> None:
    base = tiny_model.model if family == "qwen2" else tiny_gemma3(layers=4, window=4)
    model = with_lora(base)
    ids, mask, positions, groups = grouped_batch()
    decoder = model.get_base_model().get_decoder()  # type: ignore[operator]
    tree = TokenTree.of(ids, mask, prefix, groups)
    assert tree.segments == 4 and tree.segment_width == 10 - prefix
    assert tree.own_real.sum(dim=1).tolist() == [
        13 - 7,
        9 - 7,
        12 - 10,
        13 - 10,
        11 - 10,
        8 - prefix,
        10 - prefix,
    ]

    def run(packed: bool) -> tuple[Tensor, list[Tensor]]:
        model.zero_grad(set_to_none=True)
        with fused_lora(model, "default"):
            if packed:
                hidden = packed_hidden_states(decoder, ids, mask, positions, prefix, groups)
            else:
                hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[
                    positions
                ]
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(6))
        (hidden * weights).sum().backward()
        return hidden.detach(), [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n]

    ours, our_grads = run(True)
    theirs, their_grads = run(False)
    assert ours.shape == theirs.shape == (int(mask.sum()), model.config.hidden_size)
    assert_close_to_model(ours, theirs, model, torch.float32)
    for a, b in zip(our_grads, their_grads, strict=True):
        assert_close_to_model(a, b, model, torch.float32, backward=True)


def test_token_tree_computes_each_shared_token_once() -> None:
    ids, mask, positions, groups = grouped_batch()
    tree = TokenTree.of(ids, mask, 4, groups)
    packed, steps = tree.pack(ids)
    assert tree.segment_real.sum(dim=1).tolist() == [3, 0, 6, 0]  # labels in sorted order: 2, 3, 7, 9
    assert len(packed) == 4 + 4 * 6 + 7 * 6
    index = tree.index(positions)
    # the rows read the prefix and their group's run from one copy: 4 + 3 + 6 distinct shared tokens
    assert index.unique().numel() == 4 + 3 + 6 + int(tree.own_real.sum()) < index.numel()
    rows, cols = positions.nonzero(as_tuple=True)
    torch.testing.assert_close(packed[index], ids[rows, cols], rtol=0, atol=0)
    torch.testing.assert_close(steps[index], cols, rtol=0, atol=0)
    assert len(TokenTree.of(ids, mask, 4, None).pack(ids)[0]) == 4 + 7 * 9  # no labels: no segments
