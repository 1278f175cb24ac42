"""Training configuration, torch-free: one frozen dataclass per concern, validated on construction.

Holds `TrainConfig` (one step: optimizer, micro-batching, precision), `LossConfig` (which policy loss
and its knobs; the loss functions themselves are in `training.loss`) and `LoRAConfig` (the adapter's
shape; attaching it is `training.lora`). Nothing here imports torch, peft or transformers, so the
user API (`art_core.model`) and the `RemoteBackend` client can build and send these configs without
loading a trainer. `MatmulPrecision` names the precisions `training.precision` implements.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from peft import LoraConfig

MatmulPrecision = Literal["auto", "ieee", "bf16", "tf32"]
LossNormaliser = Literal["scored", "trained"]
"""Which sequences a loss is averaged over (`LossConfig.normalise_over`)."""
PRECISIONS: tuple[str, ...] = ("auto", "ieee", "bf16", "tf32")

# (epsilon, epsilon_high) used when the config leaves them as None.
DEFAULT_EPSILONS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 4.0),
}


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss to use and its knobs. Defaults follow each loss's paper (see `DEFAULT_EPSILONS`)."""

    name: str = "grpo"
    """Policy loss: one of "grpo", "dr_grpo", "dapo", "gspo", "cispo" (the keys of `DEFAULT_EPSILONS`, and of `training.loss.LOSSES`)."""
    epsilon: float | None = None
    """Lower clip range: the ratio (cispo: the IS weight) is clipped below at 1 - epsilon.
    None -> the loss's default: 0.2 (grpo, dr_grpo, dapo), 3e-4 (gspo), 1.0 (cispo: no lower bound, as in
    MiniMax CISPO)."""
    epsilon_high: float | None = None
    """Upper clip range: clipped above at 1 + epsilon_high. None -> 0.28 for dapo, 4.0 for cispo (as in
    OpenPipe ART), and for grpo, dr_grpo and gspo the epsilon in use (gspo with both None: 4e-4)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL estimator to the reference (base) model; 0 disables it and needs no reference."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling: per-token weight min(exp(old_logprobs - engine_logprobs), tis_cap);
    None disables it (weight 1)."""
    normalise_over: LossNormaliser = "scored"
    """Which sequences the loss is averaged over (`num_sequences`, `num_tokens`): "scored", every
    sequence of the step's scored groups, zero-variance groups included, as in GRPO's batch mean
    and TRL; or "trained", only those with a non-zero advantage, which makes a step with one
    informative group as large as one where all are (closer to ART's advantage rescaling)."""

    def __post_init__(self) -> None:
        if self.name not in DEFAULT_EPSILONS:
            raise ValueError(f"unknown loss name {self.name!r}; choose one of {sorted(DEFAULT_EPSILONS)}")
        for label, value in (("epsilon", self.epsilon), ("epsilon_high", self.epsilon_high)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"{label} must be a finite number >= 0 (or None for the default), got {value}"
                )
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0 (0 disables KL), got {self.kl_coef}")
        if self.normalise_over not in get_args(LossNormaliser):
            raise ValueError(f"normalise_over must be 'scored' or 'trained', got {self.normalise_over!r}")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap > 0):
            raise ValueError(
                f"tis_cap must be a finite number > 0, or None to disable TIS, got {self.tis_cap}"
            )

    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with the loss's defaults filled in."""
        default_low, default_high = DEFAULT_EPSILONS[self.name]
        low = default_low if self.epsilon is None else self.epsilon
        if self.epsilon_high is not None:
            return low, self.epsilon_high
        if self.name in ("dapo", "cispo") or self.epsilon is None:
            return low, default_high
        return low, low  # grpo, dr_grpo, gspo: a user-chosen epsilon clips symmetrically


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
        """The equivalent peft `LoraConfig` (causal LM, no bias training); imports peft."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )


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
    group_pack_tokens: int = 1024
    """Where the packed forward runs the model (Llama-family bodies), whole groups share a
    micro-batch while the tokens its pass computes stay within this (a prefix common to them and
    each group's prompt count once: `batch.packed_tokens`), and within `micro_batch_tokens`; a group
    larger than this runs alone. Larger passes run the CPU's matmuls closer to their rate (SmolLM2,
    the demo's 4 x 8 rollouts, ~830 tokens: 0.74x the time of one pass per group) and hold more
    activations (SmolLM2-135M in float32: ~0.9 MB a token, since the MLP and the norms before the
    projections keep their inputs only; the demo, all four groups in one pass, peaks at 2.86 GB)."""
    logprob_chunk_size: int = 512
    """Positions per chunk when computing log-probs, so full-vocabulary logits never exist at once."""
    matmul_precision: MatmulPrecision = "auto"
    """How float32 matmuls are computed while training (weights and optimizer stay float32):
    "auto" is bf16 inputs with float32 accumulation on CPUs where that pays (native AVX512-BF16/AMX
    and a bf16 matmul measured faster than float32's, `hardware.cpu_bf16_pays`; the frozen base
    projections then run on bf16 copies of their weights, `training.bf16_base`),
    TF32 on CUDA GPUs and exact float32 elsewhere; "ieee" is always exact; see `art_core.training.precision`."""
    beta: InitVar[float | None] = None
    """ART 0.4's KL coefficient (a k3 KL term in the loss, to the base model): sets `loss.kl_coef`.
    Not stored; `loss.kl_coef` is the field."""

    def __post_init__(self, beta: float | None) -> None:
        if beta is not None:
            if self.loss.kl_coef not in (0.0, beta):
                raise ValueError(
                    f"beta={beta} and loss.kl_coef={self.loss.kl_coef} disagree; set one of them"
                )
            object.__setattr__(self, "loss", replace(self.loss, kl_coef=float(beta)))
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive finite number, got {self.learning_rate}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not all(0 <= beta < 1 for beta in self.adam_betas):
            raise ValueError(f"adam_betas must both be in [0, 1), got {self.adam_betas}")
        if self.micro_batch_tokens < 1 or self.logprob_chunk_size < 1 or self.group_pack_tokens < 1:
            raise ValueError("micro_batch_tokens, group_pack_tokens and logprob_chunk_size must be >= 1")
        if self.matmul_precision not in PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {PRECISIONS}, got {self.matmul_precision!r}")
