"""More TorchEngine replicas for one hosted model (`TorchServing(replicas=N)`): their models,
publishing, and rebuilding one that dies.

Replica 0 is the TorchEngine on the trainer's own peft model (what one replica is). Replicas 1..N-1
each load the base weights again, attach the same LoRA under the trainer's adapter name and copy
its weights in (`LoraCopies`); all N sit behind one `ReplicatedEngine`. After a train step, while
every replica is paused, `LoraCopies.publish()` copies the trained LoRA into each copy (down ones
included); `resume()` then re-merges every replica's serving copy before its next batch, so no
replica serves the old step once the new one serves anywhere.

A replica that dies is rebuilt by `TorchReplicaFactory`: a new TorchEngine on the same model (the
weights are not loaded again). Before it takes requests (`catch_up`, which the router runs while
nothing is paused) the adapters its predecessor loaded by name are dropped from the model (the
router loads the published ones again), a copy gets the trainer's live LoRA copied in, and the
serving copy is re-merged.

`TorchServing(replica_processes=True)` runs every replica in a child process of its own instead
(`ProcessEngine`, engine.torch.process_engine), with `cores // N` torch threads each: in-process
replicas share one GIL and one OpenMP pool and do not scale on CPU (docs/distributed.md has the
figures). All N are children, replica 0 too: the trainer's model serves none of them, so the
parent's GIL is left to the HTTP server, the router and the trainer, and every replica is alike
(one build, one factory, one publish path); the cost is one more copy of the weights (N + the
trainer's). Measured at the engine level on 2 cores (bench/replica_modes.py, docs/distributed.md)
two children were as fast as or faster than replica 0 here plus one child, never slower. Each child builds its model with `ReplicaModel` and mirrors one `SharedLora` (shared
memory, allocated once): `ProcessLora.publish()`, with every replica paused, writes the trainer's
LoRA there and has each child copy it in and re-merge, returning once all have; a rebuilt child
(`ProcessReplicaFactory`) does the same in `catch_up`. A child that exits is marked down at once
(`ProcessEngine.on_death`), not only when a request finds it gone. Left out: routing and when
revival runs (`art_core.engine.replicas`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from art_core.engine.config import EngineConfig
from art_core.engine.errors import EngineClosedError
from art_core.engine.protocol import Engine
from art_core.engine.replicas import ReplicatedEngine, RoutingConfig
from art_core.engine.revival import ReviveConfig
from art_core.engine.torch.adapters import modes_kept
from art_core.engine.torch.engine import TorchEngine
from art_core.engine.torch.process_engine import ProcessEngine, SharedLora
from art_core.engine.torch.threads import usable_cpus
from art_core.host.records import ModelSpec
from art_core.models.loading import load_model
from art_core.training.config import LoRAConfig
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


@dataclass(frozen=True)
class ReplicaModel:
    """Builds one replica's model: the base weights loaded again, the LoRA attached under the
    trainer's adapter name, frozen. Picklable: a replica process runs it (`ProcessEngine`)."""

    base_model: str
    """What `load_model` loads (`ModelSpec.base_model`)."""
    trust_remote_code: bool
    """`ModelSpec.trust_remote_code`."""
    lora: LoRAConfig
    """The LoRA's shape (`ModelSpec.lora`), as the trainer's."""
    adapter: str
    """The adapter name, as the trainer's."""

    def __call__(self) -> tuple[Any, Any]:
        """(the peft model, its tokenizer)."""
        loaded = load_model(self.base_model, trust_remote_code=self.trust_remote_code)
        model = attach_lora(loaded.model, self.lora, adapter_name=self.adapter)
        model.requires_grad_(False)
        return model, loaded.tokenizer


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

    def model(self, replica: int) -> Any:
        """Replica `replica`'s model: the trainer's for 0, else its copy."""
        return self.source if replica == 0 else self.copies[replica - 1]

    def sync(self, replica: int) -> None:
        """Copy the trainer's adapter into replica `replica`'s copy (nothing to do for 0)."""
        if replica > 0:
            copy_adapter_weights(self.source, self.copies[replica - 1], self.adapter)


def drop_adapters(model: Any, keep: frozenset[str]) -> list[str]:
    """Delete peft `model`'s adapters other than `keep` (those a dead engine loaded); returns their names."""
    dropped = [name for name in list(model.peft_config) if name not in keep]
    with modes_kept(model):
        for name in dropped:
            model.delete_adapter(name)
    return dropped


@dataclass
class TorchReplicaFactory:
    """Rebuilds a dead replica as a new TorchEngine on its model (`ReplicaFactory`, engine.revival)."""

    copies: LoraCopies
    """The replicas' models and the trainer's LoRA they follow."""
    tokenizer: Any
    """The tokenizer every replica shares."""
    config: EngineConfig
    """The replicas' engine settings."""
    keep: frozenset[str]
    """The adapters the models had when served (the trainer's own); others a dead engine loaded."""

    def build(self, index: int) -> Engine:
        """A new TorchEngine on replica `index`'s model (reads it only: a step may be training)."""
        return TorchEngine(self.copies.model(index), self.tokenizer, self.config)

    def catch_up(self, index: int, engine: Engine) -> None:
        """Drop its predecessor's named adapters, copy the live LoRA in, re-merge before serving."""
        dropped = drop_adapters(self.copies.model(index), self.keep)
        if dropped:
            logger.info(
                "replica %d: dropped adapters %s of its dead engine (they are loaded again)", index, dropped
            )
        self.copies.sync(index)
        if isinstance(engine, TorchEngine):
            engine.weights_updated()


def torch_replicas(
    spec: ModelSpec,
    peft_model: Any,
    tokenizer: Any,
    config: EngineConfig,
    replicas: int,
    routing: RoutingConfig,
    adapter: str,
    revive: ReviveConfig | None = None,
) -> tuple[ReplicatedEngine, LoraCopies]:
    """`replicas` TorchEngines on `peft_model` and `replicas - 1` copies of it, behind one router
    that rebuilds a dead one (`revive`)."""
    engines = [TorchEngine(peft_model, tokenizer, config)]
    copies: list[Any] = []
    build = ReplicaModel(spec.base_model, spec.trust_remote_code, spec.lora, adapter)
    try:
        for _ in range(replicas - 1):
            copy, _tokenizer = build()
            copy_adapter_weights(peft_model, copy, adapter)
            copies.append(copy)
            engines.append(TorchEngine(copy, tokenizer, config))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    logger.info("%s: %d TorchEngine replicas", spec.name, replicas)
    lora = LoraCopies(peft_model, copies, adapter)
    factory = TorchReplicaFactory(lora, tokenizer, config, frozenset(peft_model.peft_config))
    return ReplicatedEngine(engines, routing, factory=factory, revive=revive), lora


@dataclass
class ProcessLora:
    """The trainer's peft model and the replica processes that mirror its live LoRA (`SharedLora`)."""

    source: Any
    """The trainer's peft model."""
    shared: SharedLora
    """The shared-memory buffer every replica process copies its LoRA from."""
    replicated: ReplicatedEngine | None = None
    """The router over the replica processes (set once built)."""

    def publish(self) -> int:
        """Write the trainer's LoRA to the buffer and have every live replica copy it in (returns
        once all have); call it with every replica paused. Returns how many tensors each got."""
        self.shared.write(self.source)
        assert self.replicated is not None
        for engine in self.replicated.replicas:
            if isinstance(engine, ProcessEngine) and not engine.closed:
                try:
                    engine.sync_lora()
                except EngineClosedError:  # it died: marked down, and its rebuild catches up
                    pass
        return len(self.shared.layout)

    def sync(self, engine: ProcessEngine) -> None:
        """Bring one (rebuilt) replica process to the trainer's live LoRA."""
        self.shared.write(self.source)
        engine.sync_lora()


@dataclass
class ProcessReplicaFactory:
    """Rebuilds a dead replica process as a new child (`ReplicaFactory`, engine.revival)."""

    lora: ProcessLora
    """The trainer's LoRA the replicas follow."""
    build_model: ReplicaModel
    """What each child builds."""
    config: EngineConfig
    """The replicas' engine settings."""
    threads: int
    """Torch threads of each child."""

    def build(self, index: int) -> Engine:
        """A new child for replica `index` (its model loaded from disk; the trainer's is not touched)."""
        engine = spawn_replica(self.lora, self.build_model, self.config, self.threads, index)
        engine.wait_ready()
        return engine

    def catch_up(self, index: int, engine: Engine) -> None:
        """Copy the live LoRA into the new child (it loaded no named adapter: the router loads them)."""
        assert isinstance(engine, ProcessEngine)
        self.lora.sync(engine)


def spawn_replica(
    lora: ProcessLora, build: ReplicaModel, config: EngineConfig, threads: int, index: int
) -> ProcessEngine:
    """Replica `index`'s child process, started (call `wait_ready()`); it is marked down in
    `lora.replicated` as soon as it exits."""
    engine = ProcessEngine(build, lora.shared, config, threads, name=f"art-replica-{index}", wait=False)

    def died(dead: ProcessEngine) -> None:
        if lora.replicated is not None:
            lora.replicated.mark_down(index, "its process exited", dead)

    engine.on_death = died
    return engine


def process_replicas(
    spec: ModelSpec,
    peft_model: Any,
    config: EngineConfig,
    replicas: int,
    routing: RoutingConfig,
    adapter: str,
    revive: ReviveConfig | None = None,
) -> tuple[ReplicatedEngine, ProcessLora]:
    """`replicas` TorchEngines, each in a child process with `cores // replicas` torch threads,
    mirroring `peft_model`'s LoRA, behind one router that rebuilds a dead one (`revive`)."""
    lora = ProcessLora(peft_model, SharedLora.of(peft_model, adapter))
    build = ReplicaModel(spec.base_model, spec.trust_remote_code, spec.lora, adapter)
    threads = max(1, usable_cpus() // replicas)
    engines: list[ProcessEngine] = []
    try:
        for index in range(replicas):  # they load side by side
            engines.append(spawn_replica(lora, build, config, threads, index))
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    factory = ProcessReplicaFactory(lora, build, config, threads)
    lora.replicated = ReplicatedEngine(engines, routing, factory=factory, revive=revive)
    logger.info("%s: %d TorchEngine replica processes, %d torch thread(s) each", spec.name, replicas, threads)
    return lora.replicated, lora
