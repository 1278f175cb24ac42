"""ART's `art.dev` config dicts at our path, for scripts that pass them (`_internal_config`, `_config`).

They are ART's TypedDicts (plain dicts at run time). What they map onto, and what raises:
- `InternalModelConfig(peft_args=PeftArgs(r=..., lora_alpha=...))` for `TrainableModel(_internal_config=...)`:
  sets `lora_rank` / `lora_alpha`; every other section or key raises (engine and serving options
  are set on the backend: `LocalBackend(serving=TorchServing(...) or VLLMServing(...))`).
- `TrainConfig(...)` for `model.train(groups, _config=...)`: the same keys as ART 0.5's
  `backend.train(...)` keyword arguments, mapped by `art_core.training.art_args` (unsupported ones
  raise unless at ART's default).
- `OpenAIServerConfig` exists for signatures only: `register(..., _openai_client_config=...)` raises.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class PeftArgs(TypedDict, total=False):
    """LoRA options: `r` (rank) and `lora_alpha` map onto `TrainableModel.lora_rank` / `lora_alpha`."""

    r: int
    lora_alpha: int


class InternalModelConfig(TypedDict, total=False):
    """ART's unstable model options; only `peft_args` maps here (see the module docstring)."""

    peft_args: PeftArgs
    init_args: dict[str, Any]
    engine_args: dict[str, Any]
    trainer_args: dict[str, Any]


class TrainConfig(TypedDict, total=False):
    """ART's `dev.TrainConfig` knobs (0.4 and 0.5); see `art_core.training.art_args` for each."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    kl_ref_adapter_path: str | None
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    num_trajectories_learning_rate_multiplier_power: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class OpenAIServerConfig(TypedDict, total=False):
    """ART's vLLM server options; not supported (serving is configured on the backend)."""

    log_file: str
    server_args: dict[str, Any]
    engine_args: dict[str, Any]


__all__ = ["InternalModelConfig", "OpenAIServerConfig", "PeftArgs", "TrainConfig"]
