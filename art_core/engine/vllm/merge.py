"""LoRA merged into base weights, as checkpoint-named tensors: what `weight_sync="merged"` loads into vLLM.

`merged_tensors(adapter_dir, base_dir, expand=...)` reads a peft LoRA folder (`adapter_config.json`,
`adapter_model.safetensors`) and the base model's safetensors and yields `(name, W + scale * B @ A)`
for every LoRA-targeted weight, under the base checkpoint's own names (`model.layers.0.self_attn.
q_proj.weight`), so vLLM's `load_weights` maps them as it maps the checkpoint. The product is taken
in float32 and cast to the requested dtype. `expand` lets the caller widen each targeted module to
the modules vLLM fuses with it (q/k/v into qkv_proj, gate/up into gate_up_proj): those, and every
other tensor of each module (a bias), come unchanged from the base, so a fused vLLM layer is always
reloaded whole.

Only plain LoRA is merged: DoRA, LoRA biases, `modules_to_save`, embedding LoRA and per-module
rank/alpha patterns raise `UnsupportedAdapterError` (serve those with `weight_sync="lora"`).

Pure apart from reading the files; imports torch and safetensors, not vLLM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["LoRAFactors", "UnsupportedAdapterError", "lora_scale", "merged_tensors", "read_lora"]

_PEFT_PREFIX = "base_model.model."


class UnsupportedAdapterError(ValueError):
    """The adapter has a feature the merge does not implement (the message names it)."""


@dataclass(frozen=True)
class LoRAFactors:
    """One module's LoRA: the base weight `weight` (checkpoint name) gets `scale * B @ A`."""

    weight: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float


def lora_scale(config: dict[str, Any]) -> float:
    """peft's scaling for a uniform adapter: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    if r < 1:
        raise UnsupportedAdapterError(f"LoRA rank must be >= 1, got {r}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _check_supported(config: dict[str, Any]) -> None:
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
    }
    found = [what for key, what in unsupported.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        found.append(f"bias={config['bias']!r}")
    if found:
        raise UnsupportedAdapterError(
            f"weight_sync='merged' cannot merge an adapter with {', '.join(found)}: "
            "serve it with weight_sync='lora'"
        )


def read_lora(adapter_dir: Path) -> list[LoRAFactors]:
    """The adapter's (A, B, scale) per targeted module, keyed by the base checkpoint's weight name."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    _check_supported(config)
    scale = lora_scale(config)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise UnsupportedAdapterError(
                f"adapter tensor {key!r} is not a LoRA A/B weight (embedding LoRA, a bias or a saved "
                "module?): serve it with weight_sync='lora'"
            )
        pairs.setdefault(module.removeprefix(_PEFT_PREFIX), {})[part[0]] = tensor
    factors = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise UnsupportedAdapterError(f"adapter module {module!r} has only lora_{''.join(ab)}")
        factors.append(LoRAFactors(f"{module}.weight", ab["A"], ab["B"], scale))
    if not factors:
        raise UnsupportedAdapterError(f"{adapter_dir} holds no LoRA weights")
    return factors


def merge_one(base: torch.Tensor, lora: LoRAFactors, dtype: torch.dtype) -> torch.Tensor:
    """`base + scale * B @ A`, computed in float32, returned in `dtype`."""
    delta = lora.b.to(torch.float32) @ lora.a.to(torch.float32)
    if delta.shape != base.shape:
        raise UnsupportedAdapterError(
            f"LoRA {lora.weight}: B @ A is {tuple(delta.shape)}, the base weight {tuple(base.shape)}"
        )
    return (base.to(torch.float32) + lora.scale * delta).to(dtype)


class _BaseCheckpoint:
    """Tensors of an HF safetensors folder (one file or an index), opened lazily by name."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            single = folder / "model.safetensors"
            with safe_open(str(single), framework="pt") as handle:
                self.files = {k: single for k in handle.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise FileNotFoundError(f"{folder} has no model.safetensors(.index.json)")

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise UnsupportedAdapterError(
                f"the base checkpoint has no tensor {name!r} for the LoRA to merge into"
            )
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)


def merged_tensors(
    adapter_dir: Path | str,
    base_dir: Path | str,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    expand: Callable[[str], list[str]] = lambda module: [module],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(checkpoint name, tensor)` for every tensor of the LoRA-targeted modules (widened by `expand`,
    which maps a module path to the module paths vLLM loads together with it), merged where a LoRA
    targets it, else the base's; in `dtype` on `device`, one module group at a time, in name order."""
    factors = {f.weight: f for f in read_lora(Path(adapter_dir))}
    base = _BaseCheckpoint(Path(base_dir))
    modules: list[str] = []
    for weight in factors:
        for module in expand(weight.removesuffix(".weight")):
            if module not in modules:
                modules.append(module)
    names = base.names()
    missing = sorted(w for w in factors if w not in base.files)
    if missing:
        raise UnsupportedAdapterError(f"the base checkpoint has no {missing[:3]} for the LoRA to merge into")
    for module in sorted(modules):
        for name in sorted(n for n in names if n.rpartition(".")[0] == module):
            tensor = base.get(name).to(device)
            lora = factors.get(name)
            if lora is None:
                yield name, tensor.to(dtype)
            else:
                on_device = LoRAFactors(name, lora.a.to(device), lora.b.to(device), lora.scale)
                yield name, merge_one(tensor, on_device, dtype)
