"""LoRA adapters: which layers get one, and attaching them so that only they train."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoRAConfig:
    """Shape of the LoRA adapter trained on top of the frozen base model."""

    r: int = 8
    """Rank of the low-rank update (higher: more capacity, more memory)."""
    alpha: int = 16
    """Scaling numerator: the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (0 keeps training deterministic)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    """Names of the linear layers that get an adapter: all attention and MLP projections of Llama/Qwen."""
    seed: int = 0
    """Seed of the adapter's initial weights, so that two runs of the same config start identically."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or isinstance(self.target_modules, str):
            raise ValueError(
                "target_modules must be a non-empty tuple of layer names, e.g. ('q_proj', 'v_proj'), "
                f"got {self.target_modules!r}"
            )

    def to_peft(self) -> LoraConfig:
        """The equivalent peft `LoraConfig` (causal LM, no bias training)."""
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )


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
