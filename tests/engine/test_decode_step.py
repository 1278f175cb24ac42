"""`decode_step` against transformers' own forward: same logits, same cache, padded rows included."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from art_core.engine.torch.decode_step import (
    decode_step,
    fuse_projections,
    prefill_step,
    supports_decode_step,
    supports_prefill_step,
)
from art_core.engine.torch.kv_cache import growing_cache
from art_core.models.loading import LoadedModel
from art_core.training.config import LoRAConfig
from art_core.training.lora import attach_lora
from tests.helpers_models import tiny_gemma3, tiny_llama, tiny_mistral, tiny_qwen3
from tests.tolerances import assert_close_to_model, rounding_tolerance

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


def _padded_batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _check_steps(model: torch.nn.Module, dtype: torch.dtype) -> None:
    prompts = [[5, 9, 33, 7, 81, 12], [44, 2, 19], [100, 3, 3, 60, 8, 21, 17, 9, 4]]
    ids, mask, positions = _padded_batch(prompts)
    caches = [growing_cache(model.config, room=8) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        last = positions[:, -1:]
        token = torch.tensor([[11], [250], [7]])
        for _ in range(4):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
            last = last + 1
            ours = decode_step(model, token, last, mask, caches[0])
            theirs = (
                model(
                    input_ids=token, attention_mask=mask, position_ids=last, cache=caches[1], use_cache=True
                )
                .logits[:, -1]
                .float()
            )
            assert_close_to_model(ours, theirs, model, dtype)
            assert_close_to_model(caches[0].layers[0].keys, caches[1].layers[0].keys, model, dtype)
            token = theirs.argmax(-1, keepdim=True)


def _check_prefill(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`prefill_step` against transformers' forward: left-padded prompts, then a second chunk of
    each on top of the cache (a prompt's rest after a cached prefix), then decode steps; the same
    logits, and the same keys and values at every position a row attends to."""
    prompts = [[5, 9, 33, 7, 81, 12], [44, 2, 19], [100, 3, 3, 60, 8, 21, 17, 9, 4]]
    ids, mask, positions = _padded_batch(prompts)
    rest = torch.tensor([[7, 8, 9], [0, 2, 3], [0, 0, 6]])  # the rests are left-padded too
    rest_mask = (rest != 0).long()
    caches = [growing_cache(model.config, room=8) for _ in range(2)]
    with torch.inference_mode():
        for chunk, chunk_mask in ((ids, mask), (rest, rest_mask)):
            before = 0 if chunk is ids else mask.shape[1]
            full_mask = chunk_mask if chunk is ids else torch.cat([mask, chunk_mask], dim=1)
            chunk_positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, before:]
            ours = prefill_step(model, chunk, chunk_positions, full_mask, caches[0])
            theirs = model(
                input_ids=chunk,
                attention_mask=full_mask,
                position_ids=chunk_positions,
                cache=caches[1],
                use_cache=True,
            )
            assert ours is not None
            assert_close_to_model(ours, theirs.logits[:, -1].float(), model, dtype)
        attended = full_mask.bool()
        for mine, reference in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.isfinite(mine.keys).all() and torch.isfinite(mine.values).all()  # padding too
            for kind in ("keys", "values"):
                ours_kv = getattr(mine, kind).transpose(1, 2)[attended]  # [attended positions, kv heads, D]
                assert_close_to_model(
                    ours_kv, getattr(reference, kind).transpose(1, 2)[attended], model, dtype
                )
        token, last = torch.tensor([[11], [250], [7]]), full_mask.cumsum(-1)[:, -1:] - 1
        for _ in range(2):
            full_mask = torch.cat([full_mask, torch.ones(3, 1, dtype=full_mask.dtype)], dim=1)
            last = last + 1
            ours = decode_step(model, token, last, full_mask, caches[0])
            theirs = (
                model(
                    input_ids=token,
                    attention_mask=full_mask,
                    position_ids=last,
                    cache=caches[1],
                    use_cache=True,
                )
                .logits[:, -1]
                .float()
            )
            assert_close_to_model(ours, theirs, model, dtype)
            token = theirs.argmax(-1, keepdim=True)


def test_prefill_step_equals_the_transformers_forward_and_skips_the_head_when_asked(
    tiny_model: LoadedModel,
) -> None:
    model = tiny_model.model.eval()
    assert supports_prefill_step(model)
    _check_prefill(model, torch.float32)
    ids, mask, positions = _padded_batch([[5, 9, 33], [44, 2]])
    cache = growing_cache(model.config, room=2)
    with torch.inference_mode():
        assert prefill_step(model, ids, positions, mask, cache, logits=False) is None
    assert cache.get_seq_length() == 3  # the keys and values are there all the same


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (tiny_llama, torch.float32),
        (tiny_llama, torch.bfloat16),
        (tiny_qwen3, torch.float32),
        (tiny_mistral, torch.float32),
    ],
    ids=["llama", "llama-bf16", "qwen3", "mistral"],
)
def test_prefill_step_of_each_family_equals_the_transformers_forward(
    make: Callable[[], torch.nn.Module], dtype: torch.dtype
) -> None:
    model = make().to(dtype).eval()
    fuse_projections(model)
    assert supports_prefill_step(model)
    _check_prefill(model, dtype)


def test_a_model_with_sliding_window_layers_prefills_through_transformers() -> None:
    model = tiny_gemma3(layers=4, window=4)
    assert supports_decode_step(model) and not supports_prefill_step(model)


def test_qwen2_decode_step_equals_the_transformers_forward(tiny_model: LoadedModel) -> None:
    assert supports_decode_step(tiny_model.model)
    _check_steps(tiny_model.model.eval(), torch.float32)


def test_llama_decode_step_equals_the_transformers_forward_in_bf16() -> None:
    model = tiny_llama(layers=4).eval()
    assert supports_decode_step(model)
    _check_steps(model, torch.float32)
    _check_steps(model.to(torch.bfloat16), torch.bfloat16)


def test_fusing_after_a_decode_step_rebuilds_what_the_step_looked_up() -> None:
    """`decode_step` keeps each layer's parts on the model; `fuse_projections` after it drops them,
    so the next step runs the fused matmuls (not the replaced modules' old weights)."""
    from art_core.engine.torch.decode_step import LAYERS

    model = tiny_llama(layers=2).eval()
    _check_steps(model, torch.float32)
    assert all(layer.qkv is None for layer in getattr(model, LAYERS))
    fuse_projections(model)
    _check_steps(model, torch.float32)
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in getattr(model, LAYERS))


@pytest.mark.parametrize("fused", [False, True])
def test_qwen3_decode_step_with_its_qk_norms_equals_the_transformers_forward(fused: bool) -> None:
    model = tiny_qwen3().eval()
    assert supports_decode_step(model)
    if fused:
        fuse_projections(model)
    _check_steps(model, torch.float32)


def test_mistral_decode_step_equals_the_transformers_forward_and_a_windowed_one_is_refused() -> None:
    model = tiny_mistral().eval()
    assert supports_decode_step(model)
    fuse_projections(model)
    _check_steps(model, torch.float32)
    assert not supports_decode_step(tiny_mistral(window=4))


@pytest.mark.parametrize("fused", [False, True])
def test_gemma3_decode_step_with_sliding_windows_equals_the_transformers_forward(fused: bool) -> None:
    model = tiny_gemma3(layers=4, window=4).eval()  # prompts of up to 9 tokens: the window truncates
    assert supports_decode_step(model)
    if fused:
        fuse_projections(model)
    _check_steps(model, torch.float32)


def test_peft_wrapped_and_sliding_window_models_are_not_supported(tiny_model: LoadedModel) -> None:
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert not supports_decode_step(attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=2)))
    config = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0,
    )  # fmt: skip
    assert not supports_decode_step(Qwen2ForCausalLM(config))


def test_fused_serving_copy_follows_the_trainers_weights(tiny_model: LoadedModel) -> None:
    """The merged serving copy's fused q/k/v and gate/up buffers get every re-merge (no stale weights)."""
    import copy

    from art_core.engine.torch.serving_weights import MergedWeights

    torch.manual_seed(0)
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live").eval()
    merged = MergedWeights(peft, "live", torch.float32)
    layer = merged.model.model.layers[0]
    fused_qkv, _ = layer.self_attn.art_qkv
    assert layer.self_attn.q_proj.weight.data_ptr() == fused_qkv.data_ptr()  # the weights are views
    with torch.no_grad():  # a "train step": the live adapter moves
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    assert merged.sync(peft) > 0
    attn, mlp = layer.self_attn, layer.mlp
    expected_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(attn.art_qkv[0], expected_qkv)
    assert torch.equal(mlp.art_gate_up[0], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # and the fused decode step of the copy equals the peft model itself
    ids, mask, positions = _padded_batch([[5, 9, 33, 7], [44, 2]])
    caches = [growing_cache(peft.config, room=4) for _ in range(2)]
    with torch.inference_mode():
        merged.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True
        )
        peft(input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[1], use_cache=True)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        token, last = torch.tensor([[3], [4]]), positions[:, -1:] + 1
        ours = decode_step(merged.model, token, last, mask, caches[0])
        theirs = peft(
            input_ids=token, attention_mask=mask, position_ids=last, cache=caches[1], use_cache=True
        )
    assert_close_to_model(ours, theirs.logits[:, -1].float(), peft, torch.float32)


def _one_step(model: torch.nn.Module) -> torch.Tensor:
    """The logits of one decode step after prefilling two left-padded rows."""
    ids, mask, positions = _padded_batch([[5, 9, 33, 7, 81], [44, 2]])
    cache = growing_cache(model.config, room=4)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        return decode_step(model, torch.tensor([[3], [4]]), positions[:, -1:] + 1, step_mask, cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_weights_give_the_same_logits_and_follow_weight_writes(dtype: torch.dtype) -> None:
    """Decode steps through oneDNN-packed weights (bf16, and float32 on every CPU) equal the plain
    ones, and a weight written in place (a re-merge) is packed again before the next step uses it."""
    from art_core.engine.torch.decode_step import PACKED_WEIGHTS, fuse_projections, pack_weights

    plain, packed = (tiny_llama(layers=4).to(dtype).eval() for _ in range(2))  # the same seed
    fuse_projections(plain)
    fuse_projections(packed)  # (not a deepcopy of `plain`: that would not keep the fused views)
    if not pack_weights(packed, True):
        pytest.skip(f"this torch has no oneDNN packed linear for {dtype} on this CPU")

    before = _one_step(packed)
    assert_close_to_model(before, _one_step(plain), plain, dtype)
    packs = getattr(packed, PACKED_WEIGHTS)
    assert len(packs) == 4 * 4 + 1  # q/k/v, o, gate/up and down of each layer, and the head
    with torch.no_grad():  # a re-merge writes the fused buffer in place, through a module's view
        for model in (plain, packed):
            model.model.layers[0].self_attn.q_proj.weight.mul_(-3.0)
    after = _one_step(packed)
    assert (after - before).abs().max() > 0.1  # the new weight is used, not the stale packed copy
    assert_close_to_model(after, _one_step(plain), plain, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packed_head_alone_gives_the_same_logits(dtype: torch.dtype) -> None:
    """`pack_weights(model, "head")` packs the output head only (what `art demo` serves with):
    the layers' matmuls stay plain, the head is packed once, the logits equal the plain model's."""
    from art_core.engine.torch.decode_step import PACKED_HEAD, PACKED_WEIGHTS, fuse_projections, pack_weights

    plain, packed = (tiny_llama(layers=2).to(dtype).eval() for _ in range(2))  # the same seed
    fuse_projections(plain)
    fuse_projections(packed)
    if not pack_weights(packed, "head"):
        pytest.skip(f"this torch has no oneDNN packed linear for {dtype} on this CPU")
    assert not hasattr(packed, PACKED_WEIGHTS)

    logits = _one_step(packed)
    packs = getattr(packed, PACKED_HEAD)
    assert list(packs) == [id(packed.lm_head.weight)]  # the head, and nothing else
    assert_close_to_model(logits, _one_step(plain), plain, dtype)


def test_float32_packing_follows_the_cpu_and_the_setting() -> None:
    """`pack_weights`' auto choice for float32: packed where bf16 does not pay (float32 is what
    such a CPU serves), plain where it does; False never packs, in either dtype."""
    from art_core.engine.torch.decode_step import PACKED_WEIGHTS, pack_weights
    from art_core.models.hardware import cpu_bf16_pays

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    auto = tiny_llama(layers=1).eval()
    assert pack_weights(auto) == (not cpu_bf16_pays())
    assert hasattr(auto, PACKED_WEIGHTS) == (not cpu_bf16_pays())
    for dtype in (torch.float32, torch.bfloat16):
        never = tiny_llama(layers=1).to(dtype).eval()
        assert not pack_weights(never, False) and not hasattr(never, PACKED_WEIGHTS)


def test_matmul_attention_equals_sdpa_on_cache_views_with_masked_columns() -> None:
    """The float32 decode step's attention (`matmul_attention`, two batched matmuls and a softmax)
    gives SDPA's values for what `decode_step` hands it: grouped queries, keys and values that are
    views of a cache buffer with room, left padding masked per row, a row that attends only to its
    new token."""
    from art_core.engine.torch.decode_step import matmul_attention

    rows, kv_heads, group, dim, length = 5, 3, 3, 16, 11
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, kv_heads, group, dim, generator=generator)
    buffer = torch.randn(2, rows, kv_heads, length + 6, dim, generator=generator)
    keys, values = buffer[0, ..., :length, :], buffer[1, ..., :length, :]  # strided, as the cache's views
    keep = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    keep[1, ..., :4] = False  # left padding
    keep[3, ..., :-1] = False  # only its new token
    bias = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    ours = matmul_attention(query, keys, values, bias, dim**-0.5)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=keep, scale=dim**-0.5
    )
    tolerance = rounding_tolerance(
        torch.float32, length=max(dim, length), scale=float(values.abs().max()), depth=2
    )
    assert (ours - theirs).abs().max() <= tolerance
    assert torch.equal(ours[3], values[3, :, -1:].expand(kv_heads, group, dim))  # one key: its value exactly
    # the decode step's bias, built once per kv head and sliced per layer, gives the same values
    per_head = torch.zeros(rows, kv_heads, 1, length + 4)
    per_head[..., 4:] = bias
    assert torch.equal(matmul_attention(query, keys, values, per_head[..., -length:], dim**-0.5), ours)
    # a wrong mask is far outside that tolerance: the test can tell
    unmasked = matmul_attention(query, keys, values, torch.zeros_like(bias), dim**-0.5)
    assert (unmasked - theirs).abs().max() > 100 * tolerance


def test_engine_config_takes_head_as_a_packing_choice_and_refuses_other_strings() -> None:
    from art_core.engine.config import EngineConfig

    assert EngineConfig(pack_weights="head").pack_weights == "head"
    with pytest.raises(TypeError, match="pack_weights must be None \\(auto\\), True, False or 'head'"):
        EngineConfig(pack_weights="all")  # type: ignore[arg-type]
