"""ART's training keyword arguments (0.5 `backend.train(...)`, `dev.TrainConfig`) mapped onto our configs.

ART 0.5 trains with `await backend.train(model, groups, learning_rate=..., loss_fn=..., ...)`,
and 0.4 takes the same knobs as a `_config: dev.TrainConfig` dict. `apply_art_args` turns them
into a `TrainConfig`:

- supported arguments set our fields (`ART_TO_OURS` says which);
- arguments we do not implement are accepted only at ART's default value, which does nothing
  (`ONLY_DEFAULT`); any other value raises `UnsupportedArtArgumentError` naming the argument;
- a name ART does not have raises `TypeError`, like any unexpected keyword argument.

Nothing is ignored: every argument either changes the config or equals what ART does without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from art_core.training.config import LossConfig, TrainConfig

ART_TO_OURS: dict[str, str] = {
    "learning_rate": "TrainConfig.learning_rate",
    "loss_fn": 'LossConfig.name ("cispo" -> "cispo", "ppo" -> "grpo", or "gspo" with sequence-level IS)',
    "ppo": 'LossConfig.name (True -> "grpo", False -> "cispo")',
    "epsilon": "LossConfig.epsilon",
    "epsilon_high": "LossConfig.epsilon_high",
    "scale_rewards": "TrainConfig.scale_rewards",
    "normalize_advantages": "TrainConfig.scale_rewards (False turns scaling off)",
    "importance_sampling_level": '"token" (default) or "sequence" (LossConfig.name "gspo", with ppo)',
    "truncated_importance_sampling": "LossConfig.tis_cap (None disables truncated IS)",
    "logprob_calculation_chunk_size": "TrainConfig.logprob_chunk_size",
    "beta": "LossConfig.kl_coef (k3 KL in the loss, as ART 0.4)",
    "precalculate_logprobs": "always on here: old log-probs come from the trainer, engine ones feed TIS",
    "verbose": "logs the step's result at INFO",
}
"""The ART arguments that map onto ours, and where they go."""

ONLY_DEFAULT: dict[str, Any] = {
    "loss_fn_config": None,
    "adam_params": None,
    "kl_penalty_coef": 0.0,
    "kl_penalty_reference_step": None,
    "kl_ref_adapter_path": None,
    "advantage_balance": 0.0,
    "max_negative_advantage_importance_sampling_weight": None,
    "mask_prob_ratio": False,
    "kimi_k2_tau": None,
    "allow_training_without_logprobs": False,
    "plot_tensors": False,
    "scale_learning_rate_by_reward_std_dev": False,
    "packed_sequence_length": None,
    "num_trajectories_learning_rate_multiplier_power": 0.0,
    "save_checkpoint": True,
    "grad_accumulation_sequences": None,
    "moe_routing_replay_bundle": None,
    "moe_routing_replay_path": None,
    "moe_routing_replay_strict": False,
}
"""ART arguments we do not implement: accepted only at ART's default (a no-op)."""

WHY_NOT: dict[str, str] = {
    "kl_penalty_coef": "KL folded into the advantages is not implemented; for a KL term in the loss "
    "pass TrainConfig(loss=LossConfig(kl_coef=...)) (or ART 0.4's beta=...)",
    "save_checkpoint": "every step is saved: the checkpoint directory is the step",
    "allow_training_without_logprobs": "only sampled tokens with their token records are trained on",
    "packed_sequence_length": "batches are cut by TrainConfig.micro_batch_tokens instead",
    "grad_accumulation_sequences": "one optimizer step per train call; micro-batches accumulate gradients",
}


class UnsupportedArtArgumentError(ValueError):
    """An ART training argument we know but do not implement, given a value other than ART's default."""


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, float) and isinstance(value, int | float) and not isinstance(value, bool):
        return math.isclose(float(value), default, abs_tol=0.0)
    return bool(value == default) and type(value) is type(default)


def _check_supported(args: Mapping[str, Any], where: str) -> None:
    for name, value in args.items():
        if name in ART_TO_OURS:
            continue
        if name not in ONLY_DEFAULT:
            raise TypeError(
                f"{where} got an unexpected keyword argument {name!r}; ART arguments it maps are "
                f"{sorted(ART_TO_OURS)}, and {sorted(ONLY_DEFAULT)} only at ART's default value"
            )
        default = ONLY_DEFAULT[name]
        if not _same(value, default):
            reason = WHY_NOT.get(name, "it is not implemented here")
            raise UnsupportedArtArgumentError(
                f"{where}: {name}={value!r} is not supported ({reason}); leave it out or pass {default!r}"
            )


def _loss_name(args: Mapping[str, Any], current: str, where: str) -> str:
    loss_fn = args.get("loss_fn")
    if "ppo" in args:
        ppo_loss = "ppo" if args["ppo"] else "cispo"
        if loss_fn is not None and loss_fn != ppo_loss:
            raise ValueError(f"{where}: loss_fn={loss_fn!r} contradicts ppo={args['ppo']!r}")
        loss_fn = ppo_loss
    if loss_fn not in (None, "cispo", "ppo"):
        raise UnsupportedArtArgumentError(
            f"{where}: loss_fn={loss_fn!r} is not supported; use 'cispo' or 'ppo' (ART's choices), or "
            f"TrainConfig(loss=LossConfig(name=...)) for one of ours"
        )
    level = args.get("importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        raise UnsupportedArtArgumentError(
            f"{where}: importance_sampling_level={level!r} is not supported; use 'token' or 'sequence'"
        )
    name = {"cispo": "cispo", "ppo": "grpo", None: current}[loss_fn]
    if level == "sequence":
        if name not in ("grpo", "gspo"):
            raise UnsupportedArtArgumentError(
                f"{where}: importance_sampling_level='sequence' needs loss_fn='ppo' (GSPO); got {name!r}"
            )
        return "gspo"
    return name


def apply_art_args(config: TrainConfig, args: Mapping[str, Any], *, where: str) -> TrainConfig:
    """`config` with ART's training arguments `args` applied (see the module docstring).

    Raises:
        TypeError: a name that is not an ART training argument.
        UnsupportedArtArgumentError: an ART argument we do not implement, at a non-default value.
        ValueError: a supported argument with a bad value (from the configs' own validation).
    """
    _check_supported(args, where)
    loss: LossConfig = config.loss
    loss_fields: dict[str, Any] = {"name": _loss_name(args, loss.name, where)}
    for ours, theirs in (("epsilon", "epsilon"), ("epsilon_high", "epsilon_high")):
        if theirs in args:
            loss_fields[ours] = args[theirs]
    if "truncated_importance_sampling" in args:
        loss_fields["tis_cap"] = args["truncated_importance_sampling"]
    if "beta" in args:
        loss_fields["kl_coef"] = float(args["beta"])
    fields: dict[str, Any] = {"loss": replace(loss, **loss_fields)}
    if "learning_rate" in args:
        fields["learning_rate"] = args["learning_rate"]
    if "scale_rewards" in args:
        fields["scale_rewards"] = bool(args["scale_rewards"])
    if args.get("normalize_advantages") is False:
        fields["scale_rewards"] = False
    if "logprob_calculation_chunk_size" in args:
        fields["logprob_chunk_size"] = args["logprob_calculation_chunk_size"]
    return replace(config, **fields)


ART_05_DEFAULTS = TrainConfig(loss=LossConfig(name="cispo"))
"""The base of a 0.5-style call that passes no `config`: ART 0.5's default loss (CISPO), our other defaults."""
