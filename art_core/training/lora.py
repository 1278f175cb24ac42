"""Attaching LoRA adapters so that only they train (their shape, `LoRAConfig`, is in `training.config`)."""

from __future__ import annotations

import warnings

import torch
from peft import PeftModel, get_peft_model
from torch import nn

from art_core.training.config import LoRAConfig


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
        if isinstance(model, PeftModel):
            model.add_adapter(adapter_name, config.to_peft())
            peft_model = model
        else:
            peft_model = get_peft_model(model, config.to_peft(), adapter_name=adapter_name)
    marker = f".{adapter_name}."
    for name, param in peft_model.named_parameters():
        param.requires_grad = "lora_" in name and marker in name
    peft_model.train(was_training)  # a new wrapper module would otherwise report train mode
    if not any(param.requires_grad for param in peft_model.parameters()):
        raise ValueError(f"no LoRA weights were created for adapter {adapter_name!r}; check target_modules")
    return peft_model
