"""More TorchEngine replicas for one hosted model (`TorchServing(replicas=N)`): their models and publishing.

Replica 0 is the TorchEngine on the trainer's own peft model (what one replica is). Replicas 1..N-1
each load the base weights again, attach the same LoRA under the trainer's adapter name and copy
its weights in (`LoraCopies`); all N sit behind one `ReplicatedEngine`. After a train step, while
every replica is paused, `LoraCopies.publish()` copies the trained LoRA into each copy; `resume()`
then re-merges every replica's serving copy before its next batch, so no replica serves the old
step once the new one serves anywhere. Left out: routing (`art_core.engine.replicas`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from art_core.engine.config import EngineConfig
from art_core.engine.replicas import ReplicatedEngine, RoutingConfig
from art_core.engine.torch.engine import TorchEngine
from art_core.host.records import ModelSpec
from art_core.models.loading import load_model
from art_core.training.lora import attach_lora

logger = logging.getLogger(__name__)


def copy_adapter_weights(source: Any, target: Any, adapter: str) -> int:
    """Copy adapter `adapter`'s parameters of peft model `source` into the same-named ones of
    `target` (same base, same LoRA settings); returns how many tensors were copied."""
    marker = f".{adapter}."
    targets = dict(target.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, param in source.named_parameters():
            if marker not in name:
                continue
            if name not in targets:
                raise ValueError(f"the replica's model has no parameter {name!r}: it was built differently")
            targets[name].copy_(param)
            copied += 1
    if not copied:
        raise ValueError(f"the trainer's model has no parameters of adapter {adapter!r}")
    return copied


@dataclass
class LoraCopies:
    """The trainer's peft model and the replicas' copies of it, whose adapter follows the trainer's."""

    source: Any
    """The trainer's peft model (replica 0 serves it directly)."""
    copies: list[Any]
    """The models of replicas 1..N-1."""
    adapter: str
    """The adapter they mirror (the trainer's live one)."""

    def publish(self) -> int:
        """Copy the trainer's adapter into every copy; call it with every replica paused."""
        return sum(copy_adapter_weights(self.source, copy, self.adapter) for copy in self.copies)


def torch_replicas(
    spec: ModelSpec,
    peft_model: Any,
    tokenizer: Any,
    config: EngineConfig,
    replicas: int,
    routing: RoutingConfig,
    adapter: str,
) -> tuple[ReplicatedEngine, LoraCopies]:
    """`replicas` TorchEngines on `peft_model` and `replicas - 1` copies of it, behind one router."""
    engines = [TorchEngine(peft_model, tokenizer, config)]
    copies: list[Any] = []
    try:
        for _ in range(replicas - 1):
            loaded = load_model(spec.base_model, trust_remote_code=spec.trust_remote_code)
            copy = attach_lora(loaded.model, spec.lora, adapter_name=adapter)
            copy.requires_grad_(False)
            copy_adapter_weights(peft_model, copy, adapter)
            copies.append(copy)
            engines.append(TorchEngine(copy, tokenizer, config))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    logger.info("%s: %d TorchEngine replicas", spec.name, replicas)
    return ReplicatedEngine(engines, routing), LoraCopies(peft_model, copies, adapter)
