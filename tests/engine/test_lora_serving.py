"""The unmerged serving copy (`lora_serving.UnmergedWeights`): the trainer's base weights shared,
packed once, the LoRA update live; the same logits as the peft model, before and after a train step."""

from __future__ import annotations

import copy

import pytest
import torch

from art_core.engine.torch.decode_step import GATE_UP, LOW_RANK, PACKED_WEIGHTS, QKV, decode_step
from art_core.engine.torch.engine import EngineConfig, TorchEngine
from art_core.engine.torch.kv_cache import growing_cache
from art_core.engine.torch.lora_serving import UnmergedLinear, UnmergedWeights
from art_core.engine.torch.serving_copy import serving_copy
from art_core.engine.torch.serving_weights import MergedWeights, UnsupportedAdapterError
from art_core.models.hardware import cpu_bf16_pays
from art_core.models.loading import LoadedModel
from art_core.training.config import LoRAConfig
from art_core.training.lora import attach_lora
from tests.helpers_models import tiny_llama
from tests.tolerances import assert_close_to_model

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)


def _trained(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every LoRA tensor moves in place (its version counter bumps)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def _prefill_and_steps(served: torch.nn.Module, peft: torch.nn.Module, steps: int = 3) -> None:
    """Prefill two left-padded rows through each model's forward, then decode: `decode_step` on the
    served copy against the peft model's forward, logits and cache alike."""
    ids = torch.tensor([[0, 0, 5, 9, 33, 7], [44, 2, 19, 8, 1, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [growing_cache(peft.config, room=steps) for _ in range(2)]
    with torch.inference_mode():
        ours = served(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True
        )
        theirs = peft(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[1], use_cache=True
        )
        assert_close_to_model(ours.logits[:, -1].float(), theirs.logits[:, -1].float(), peft, torch.float32)
        token, last = theirs.logits[:, -1].argmax(-1, keepdim=True), positions[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            last = last + 1
            step = decode_step(served, token, last, mask, caches[0])
            reference = peft(
                input_ids=token, attention_mask=mask, position_ids=last, cache=caches[1], use_cache=True
            )
            expected = reference.logits[:, -1].float()
            assert_close_to_model(step, expected, peft, torch.float32)
            assert_close_to_model(
                caches[0].layers[-1].values, caches[1].layers[-1].values, peft, torch.float32
            )
            token = expected.argmax(-1, keepdim=True)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_unmerged_copy_decodes_like_the_peft_model_and_follows_its_training(
    tiny_model: LoadedModel, family: str, pack: bool
) -> None:
    """Qwen2 (q/k/v biases: the fused group's stacked bias) and Llama; packed (the fused, packed
    decode step) and not (the modules themselves); before and after the adapter trains."""
    torch.manual_seed(0)
    base = copy.deepcopy(tiny_model.model) if family == "qwen2" else tiny_llama(layers=3)
    peft = attach_lora(base, LoRAConfig(r=4, alpha=8), adapter_name="live").eval()
    _trained(peft, seed=1)  # LoRA's B starts at zero: give the update a value to get wrong
    served = UnmergedWeights(peft, "live", pack=pack)
    if pack and not served.packed:
        pytest.skip("this torch has no oneDNN packed float32 linear here")
    assert served.packed == pack and hasattr(served.model, PACKED_WEIGHTS) == pack
    _prefill_and_steps(served.model, peft)

    packs = dict(getattr(served.model, PACKED_WEIGHTS, {}))
    _trained(peft, seed=2)
    assert served.stale(peft)
    assert served.sync(peft) > 0 and served.merges == 2 and not served.stale(peft)
    _prefill_and_steps(served.model, peft)
    if pack:  # the adapted projections' packs hold the new update (made in `sync`); the head's is kept
        now = getattr(served.model, PACKED_WEIGHTS)
        head = id(served.model.lm_head.weight)
        assert now.keys() == packs.keys() and now[head] is packs[head]
        adapted = [key for key in packs if key != head]
        assert adapted and all(now[k] is not packs[k] and now[k].update for k in adapted)
        assert all(now[k].packed is packs[k].packed for k in adapted)  # merged into the same buffers
        assert served.sync(peft) == 0  # nothing changed: nothing is merged or packed again
        assert all(getattr(served.model, PACKED_WEIGHTS)[k] is now[k] for k in now)


def test_a_packed_decode_step_merges_a_changed_update_itself_when_sync_did_not(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed float32 decode step multiplies by base + update merged into one packed matrix; if
    the update's tensors changed and nothing merged them again (here `sync`'s `refresh_packs` is
    skipped), the step sees it and merges them itself rather than serve the old update."""
    from art_core.engine.torch import lora_serving

    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live").eval()
    _trained(peft, seed=7)
    served = UnmergedWeights(peft, "live", pack=True)
    if not served.packed:
        pytest.skip("this torch has no oneDNN packed float32 linear here")
    _prefill_and_steps(served.model, peft)
    monkeypatch.setattr(lora_serving, "refresh_packs", lambda model: 0)
    _trained(peft, seed=8)
    assert served.sync(peft) > 0
    _prefill_and_steps(served.model, peft)


def test_the_unmerged_copy_holds_no_copy_of_the_trainers_weights(tiny_model: LoadedModel) -> None:
    """Every parameter of the copy is the trainer's own tensor; the adapted projections are
    `UnmergedLinear`s over the trainer's base layers; the adapter stays trainable and untouched."""
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live")
    peft.train()
    trainable = {name for name, p in peft.named_parameters() if p.requires_grad}
    served = UnmergedWeights(peft, "live")
    theirs = {p.data_ptr() for p in peft.parameters()}
    assert all(p.data_ptr() in theirs for p in served.model.parameters())
    assert served.shared_bytes == sum(p.numel() * p.element_size() for p in served.model.parameters())
    q_proj = served.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, UnmergedLinear)
    assert q_proj.weight is peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert {name for name, p in peft.named_parameters() if p.requires_grad} == trainable
    assert all(m.training for m in peft.modules()) and not served.model.training  # its eval mode is its own


def test_a_fused_groups_projections_update_through_views_of_its_stacked_update(
    tiny_model: LoadedModel,
) -> None:
    """Packed: q/k/v's and gate/up's own updates (prefill's modules) are views of the group's
    stacked one (the decode step's), so a sync copies each adapter tensor once; both follow a step."""
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live").eval()
    served = UnmergedWeights(peft, "live", pack=True)
    if not served.packed:
        pytest.skip("this torch has no oneDNN packed float32 linear here")
    layers = served.model.model.layers
    groups = [(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in layers]
    groups += [(layer.mlp, ("gate_proj", "up_proj")) for layer in layers]
    for owner, names in groups:
        stacked = getattr(owner, (QKV if "q_proj" in names else GATE_UP) + "_lora")
        for name in names:
            part = getattr(getattr(owner, name), LOW_RANK)
            for mine, theirs in ((part.down_t, stacked.down_t), (part.up_t, stacked.up_t)):
                assert mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
    adapted = sum(1 for module in served.model.modules() if isinstance(module, UnmergedLinear))
    _trained(peft, seed=3)
    # one refresh per fused group and per other adapted projection (o_proj, down_proj)
    assert served.sync(peft) == len(groups) + adapted - 3 * len(layers) - 2 * len(layers)
    _prefill_and_steps(served.model, peft)


def test_the_auto_choice_serves_unmerged_exactly_where_float32_is_packed(tiny_model: LoadedModel) -> None:
    """`serving_copy` with `unmerged` None: unmerged where the float32 base is packed (a CPU where
    bf16 does not pay), merged elsewhere; False: always merged; True: unmerged; a bf16 copy: merged."""
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live")
    auto = serving_copy(peft, None, torch.float32)
    assert isinstance(auto, UnmergedWeights) == (not cpu_bf16_pays() and torch.backends.mkldnn.is_available())
    assert isinstance(serving_copy(peft, None, torch.float32, unmerged=False), MergedWeights)
    assert isinstance(serving_copy(peft, None, torch.float32, unmerged=True), UnmergedWeights)
    assert isinstance(serving_copy(peft, None, torch.bfloat16, unmerged=True), MergedWeights)
    with pytest.raises(TypeError, match="serve_unmerged must be None"):
        EngineConfig(serve_unmerged="yes")  # type: ignore[arg-type]


def test_an_adapter_the_unmerged_copy_cannot_serve_is_served_merged(tiny_model: LoadedModel) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(tiny_model.model), config, adapter_name="live")
    with pytest.raises(UnsupportedAdapterError, match="embed_tokens"):
        UnmergedWeights(peft, "live")
    assert isinstance(serving_copy(peft, None, torch.float32, unmerged=True), MergedWeights)


async def test_the_engine_samples_the_same_tokens_unmerged_as_merged(tiny_model: LoadedModel) -> None:
    """Greedy completions through the engine, served unmerged and merged, before and after a
    pause-train-resume: the same tokens, logprobs equal to float rounding."""
    from art_core.engine.sampling import SamplingParams
    from art_core.engine.torch.engine import GenerationRequest

    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live")
    _trained(peft, seed=3)
    prompt_sets = [[5, 9, 33, 7, 81, 12], [44, 2, 19], [100, 3, 3, 60, 8, 21, 17, 9, 4]]
    engines = {
        mode: TorchEngine(
            peft, tiny_model.tokenizer, EngineConfig(serve_unmerged=mode, serve_dtype=torch.float32)
        )
        for mode in (True, False)
    }
    try:
        assert engines[True].serves_unmerged and not engines[False].serves_unmerged
        assert isinstance(engines[False]._serving, MergedWeights)
        for round_ in range(2):
            results = {}
            for mode, engine in engines.items():
                params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
                results[mode] = [
                    await engine.generate(GenerationRequest(ids, params, adapter="live"))
                    for ids in prompt_sets
                ]
            for unmerged, merged in zip(results[True], results[False], strict=True):
                assert unmerged[0].token_ids == merged[0].token_ids
                assert torch.allclose(
                    torch.tensor(unmerged[0].logprobs), torch.tensor(merged[0].logprobs), atol=1e-4
                )
            if round_ == 0:
                for engine in engines.values():
                    engine.pause()
                _trained(peft, seed=4)
                for engine in engines.values():
                    engine.resume()
        assert engines[True].stats().merges == 2
    finally:
        for engine in engines.values():
            engine.close()


def test_base_weights_written_around_their_version_counters_are_packed_again_on_request(
    tiny_model: LoadedModel,
) -> None:
    """A base weight written through `.data` (no version bump) keeps its stale packed copy until
    `sync(base=True)` (what the engine's `weights_updated()` asks for), then decodes like peft."""
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live").eval()
    _trained(peft, seed=5)
    served = UnmergedWeights(peft, "live", pack=True)
    if not served.packed:
        pytest.skip("this torch has no oneDNN packed float32 linear here")
    _prefill_and_steps(served.model, peft)  # packs every base weight
    q_proj = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    version = q_proj.weight._version
    q_proj.weight.data.copy_(q_proj.weight.data * -3.0)
    assert q_proj.weight._version == version  # the write the counters miss
    with pytest.raises(AssertionError):
        _prefill_and_steps(served.model, peft)  # decode steps still multiply by the old packed weight
    served.sync(peft, base=True)
    _prefill_and_steps(served.model, peft)


def test_an_adapter_on_some_projections_of_a_fused_group_decodes_like_peft(tiny_model: LoadedModel) -> None:
    """LoRA on q and v but not k (the group's update has an empty block for k), and on down but not
    gate/up (that group runs its packed base alone)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft = get_peft_model(copy.deepcopy(tiny_model.model), config, adapter_name="live").eval()
    _trained(peft, seed=6)
    served = UnmergedWeights(peft, "live", pack=True)
    attn = served.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, UnmergedLinear) and not isinstance(attn.k_proj, UnmergedLinear)
    assert not hasattr(served.model.model.layers[0].mlp, "art_gate_up_lora")
    _prefill_and_steps(served.model, peft)
