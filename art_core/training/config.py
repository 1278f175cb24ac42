"""Training configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from art_core.training.loss import LossConfig
from art_core.training.precision import PRECISIONS, MatmulPrecision


@dataclass(frozen=True)
class TrainConfig:
    """What one call to `TrainableModel.train` does with its groups."""

    learning_rate: float = 5e-6
    """AdamW learning rate for the LoRA weights (constant; no schedule)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Which policy loss and its knobs (clip range, KL, importance-sampling cap)."""
    scale_rewards: bool = True
    """Divide group-centred advantages by the group's reward std (GRPO); False is Dr. GRPO style."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value before the optimizer step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    micro_batch_tokens: int = 4096
    """Padded tokens per forward/backward pass; gradients are accumulated across micro-batches."""
    logprob_chunk_size: int = 512
    """Positions per chunk when computing log-probs, so full-vocabulary logits never exist at once."""
    matmul_precision: MatmulPrecision = "auto"
    """How float32 matmuls are computed while training (weights and optimizer stay float32):
    "auto" is bf16 inputs with float32 accumulation on CPUs with native bf16 (AVX512-BF16/AMX),
    TF32 on CUDA GPUs and exact float32 elsewhere; "ieee" is always exact; see `art_core.training.precision`."""

    def __post_init__(self) -> None:
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive finite number, got {self.learning_rate}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not all(0 <= beta < 1 for beta in self.adam_betas):
            raise ValueError(f"adam_betas must both be in [0, 1), got {self.adam_betas}")
        if self.micro_batch_tokens < 1 or self.logprob_chunk_size < 1:
            raise ValueError("micro_batch_tokens and logprob_chunk_size must be >= 1")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {PRECISIONS}, got {self.matmul_precision!r}")
