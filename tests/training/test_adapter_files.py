"""AdapterFiles writes what peft's save_pretrained writes, byte for byte, after the first save."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel

from art_core.models.loading import LoadedModel
from art_core.training.adapter_files import AdapterFiles, peft_save, write_safetensors
from art_core.training.config import LoRAConfig
from art_core.training.lora import attach_lora


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


@pytest.mark.parametrize("adapter_name", ["default", "live"])
def test_saves_after_the_first_are_peft_s_files(
    tiny_model: LoadedModel, tmp_path: Path, adapter_name: str
) -> None:
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name=adapter_name)
    marker = f".{adapter_name}."
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n and marker in n]
    files = AdapterFiles(model, adapter_name, named)
    files.save(tmp_path / "first")
    assert files._keys is not None, "the lean path was not learned from peft's first save"
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the weights change between saves, as a train step changes them
        for _, param in named:
            param.copy_(torch.randn(param.shape, generator=generator))
    files.save(tmp_path / "ours")
    peft_save(model, adapter_name, tmp_path / "peft")
    ours, peft = _files(tmp_path / "ours"), _files(tmp_path / "peft")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(ours)
    assert ours == peft
    assert ours["adapter_model.safetensors"] != _files(tmp_path / "first")["adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model.model), str(tmp_path / "ours"))
    probe = torch.tensor([[5, 17, 300, 42]])
    model.set_adapter(adapter_name)
    with torch.no_grad():
        assert torch.equal(loaded(probe).logits, model(probe).logits)


def test_peft_save_stays_when_the_saved_tensors_are_not_the_given_parameters(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8))
    named = [(n, p) for n, p in model.named_parameters() if "lora_A" in n]  # half of what peft saves
    files = AdapterFiles(model, "default", named)
    files.save(tmp_path / "a")
    files.save(tmp_path / "b")
    assert files._keys is None
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_write_safetensors_writes_safetensors_bytes(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {f"t.{i}": (torch.arange(i * 7, i * 7 + 12) % 5).to(dtype).reshape(3, 4) for i in range(4)}
    tensors["scalar"] = torch.tensor(2.0).to(dtype)
    write_safetensors(tensors, tmp_path / "ours", metadata={"format": "pt"})
    safetensors.torch.save_file(tensors, str(tmp_path / "reference"), metadata={"format": "pt"})
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "reference").read_bytes()


def test_other_files_in_the_folder_are_not_taken_for_peft_s(tiny_model: LoadedModel, tmp_path: Path) -> None:
    model = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8))
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    folder = tmp_path / "first"
    folder.mkdir()
    (folder / "optimizer.safetensors").write_bytes(b"an earlier save's")
    files = AdapterFiles(model, "default", named)
    files.save(folder)
    files.save(tmp_path / "second")
    assert {path.name for path in (tmp_path / "second").iterdir()} == {
        path.name for path in folder.iterdir() if path.name != "optimizer.safetensors"
    }
