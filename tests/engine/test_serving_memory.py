"""The serving copy holds each tensor once: what has no LoRA and is already in the serving dtype is
the trainer's own tensor, and the rest still follows training."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from art_core.engine.torch.serving_weights import MergedWeights
from art_core.models.allocator import HeapTrimmer, free_heap_bytes, limit_arenas, release_free_memory
from art_core.models.loading import LoadedModel


def _peft(tiny_model: LoadedModel) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    return get_peft_model(copy.deepcopy(tiny_model.model), config, adapter_name="trainer")


def test_a_float32_copy_shares_what_it_would_only_copy(tiny_model: LoadedModel) -> None:
    peft_model = _peft(tiny_model)
    base = peft_model.get_base_model()
    merged = MergedWeights(peft_model, "trainer", torch.float32)
    copy_body, base_body = merged.model.model, base.model
    assert copy_body.embed_tokens.weight.data_ptr() == base_body.embed_tokens.weight.data_ptr()
    assert copy_body.norm.weight.data_ptr() == base_body.norm.weight.data_ptr()
    assert merged.model.lm_head.weight.data_ptr() == base.lm_head.weight.data_ptr()
    q_copy = copy_body.layers[0].self_attn.q_proj.weight
    assert q_copy.data_ptr() != base_body.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
    shared = sum(
        t.numel() * t.element_size()
        for t in (base_body.embed_tokens.weight, base.lm_head.weight, base_body.norm.weight)
    )
    assert merged.shared_bytes >= shared
    # The fused q/k/v bias is a view of one buffer the decode step reads: written, never shared.
    fused_bias = copy_body.layers[0].self_attn.art_qkv[1]
    assert fused_bias is not None and torch.isfinite(fused_bias).all()
    want = torch.cat(
        [base_body.layers[0].self_attn.k_proj.bias, base_body.layers[0].self_attn.v_proj.base_layer.bias]
    )
    torch.testing.assert_close(fused_bias[-want.numel() :], want)


def test_the_shared_copy_follows_the_adapter_and_a_bf16_copy_shares_nothing(tiny_model: LoadedModel) -> None:
    peft_model = _peft(tiny_model)
    merged = MergedWeights(peft_model, "trainer", torch.float32)
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["trainer"].weight.add_(1.0)
    assert merged.sync(peft_model) >= 1
    expected = layer.base_layer.weight + layer.get_delta_weight("trainer")
    torch.testing.assert_close(merged.model.model.layers[0].self_attn.q_proj.weight, expected)
    bf16 = MergedWeights(peft_model, "trainer", torch.bfloat16)
    # A cast copy shares only the float32 buffers the skeleton keeps in float32 (rotary frequencies).
    rotary = bf16.model.model.rotary_emb.buffers()
    assert bf16.shared_bytes == sum(b.numel() * b.element_size() for b in rotary if b.dtype == torch.float32)
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_the_allocator_helpers() -> None:
    assert release_free_memory() in (True, False)  # False off glibc
    try:
        limit_arenas(0)
    except ValueError as exc:
        assert "count must be >= 1" in str(exc)
    else:
        raise AssertionError("limit_arenas(0) must raise")


def test_the_free_heap_is_read_where_glibc_has_mallinfo2() -> None:
    free = free_heap_bytes()
    if free is None:
        pytest.skip("not glibc >= 2.33: the trimmer trims after every step there")
    # 200 blocks under malloc's mmap threshold, then one that stays: freeing the 200 leaves a hole
    # below it that glibc keeps (it only returns the top of the heap by itself).
    blocks = [bytearray(100_000) for _ in range(200)]
    keep = bytearray(100_000)
    before = free_heap_bytes()
    del blocks
    after = free_heap_bytes()
    assert before is not None and after is not None
    assert after - before >= 15_000_000
    assert len(keep) == 100_000


def test_the_heap_is_trimmed_when_it_grows_not_after_every_step() -> None:
    """Free heap after each step: loading garbage, then a working set of 1000 that the steps
    reuse, then growth (fragmentation) of 100 a step until it passes the slack of 250."""
    readings = iter([5000, 1000, 1000, 1100, 1200, 1300, 1000, 1000])
    trims: list[int] = []
    trimmer = HeapTrimmer(250, read_free=lambda: next(readings), trim=lambda: trims.append(1) or True)
    done = [trimmer.after_step() for _ in range(8)]
    # step 1 drops what loading left; 2 measures the working set; 3-5 stay within 1000 + 250;
    # 6 (1300) trims; 7 measures anew; 8 stays.
    assert done == [True, False, False, False, False, True, False, False]
    assert trimmer.trims == 2


def test_without_a_heap_reading_every_step_trims() -> None:
    trimmer = HeapTrimmer(read_free=lambda: None, trim=lambda: True)
    assert [trimmer.after_step() for _ in range(3)] == [True, True, True]
    with pytest.raises(ValueError, match="slack_bytes must be >= 0"):
        HeapTrimmer(-1)
