"""Attaching LoRA adapters so that only they train (their shape, `LoRAConfig`, is in `training.config`)."""

from __future__ import annotations

import re
import warnings

import torch
from peft import PeftModel, get_peft_model
from torch import nn

from art_core.training.config import LoRAConfig


def linear_targets(model: nn.Module, names: tuple[str, ...]) -> str:
    """A peft `target_modules` regex matching exactly the `nn.Linear` layers named `names`.

    Listing the layers keeps peft 0.21 from mapping MLP names onto a transformers-5 MoE's fused
    expert parameters (`ParamWrapper`: no merged serving copy, no per-row adapters). An MoE's
    experts and router stay frozen; its attention projections (and any dense MLP) get adapters.
    """
    found = sorted(
        {
            name.split(".", 2)[-1] if name.startswith("base_model.model.") else name
            for name, module in model.named_modules()
            if name.rpartition(".")[2] in names
            and (isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear))
        }
    )
    return "(" + "|".join(re.escape(name) for name in found) + ")" if found else "(?!)"


def attach_lora(model: nn.Module, config: LoRAConfig, adapter_name: str = "default") -> PeftModel:
    """Wrap `model` with a fresh LoRA adapter; afterwards only that adapter's weights are trainable.

    Modifies `model` in place (peft injects the adapter layers into it): deep-copy it first if the
    plain base model is still needed. A `PeftModel` gets `adapter_name` added beside its adapters.
    """
    was_training = model.training
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(config.seed)  # seeded init that leaves the caller's RNG untouched
        # peft 0.21 asks transformers 5 `is_gradient_checkpointing`, deprecated there: not ours to fix.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_config = config.to_peft()
        if any(name.rpartition(".")[2] in config.target_modules for name, _ in model.named_parameters()):
            # A transformers-5 MoE: its experts are parameters named like the MLP projections.
            peft_config.target_modules = linear_targets(model, config.target_modules)
        if isinstance(model, PeftModel):
            model.add_adapter(adapter_name, peft_config)
            peft_model = model
        else:
            peft_model = get_peft_model(model, peft_config, adapter_name=adapter_name)
    marker = f".{adapter_name}."
    for name, param in peft_model.named_parameters():
        param.requires_grad = "lora_" in name and marker in name
    peft_model.train(was_training)  # a new wrapper module would otherwise report train mode
    if not any(param.requires_grad for param in peft_model.parameters()):
        raise ValueError(f"no LoRA weights were created for adapter {adapter_name!r}; check target_modules")
    return peft_model
