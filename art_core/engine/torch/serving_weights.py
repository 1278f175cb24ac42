"""A serving copy of a model's weights: one LoRA adapter merged into the base, in a serving dtype.

Decoding through peft costs twice: every LoRA layer runs its two extra matmuls (and, with
`adapter_names`, splits the batch per adapter in each of them), and the trainer's weights are
float32, where bfloat16 is about 2x faster on CPUs with AMX. `MergedWeights` keeps a second,
plain transformers model of the same architecture whose weights are `cast(W + scale * B @ A)`
for every LoRA layer of one adapter (peft's own `get_delta_weight`) and a cast copy of
everything else (embeddings, norms, head, buffers). Rows for that adapter decode on it with no
peft code at all.

Staleness. The copy remembers, per tensor, a stamp of its sources: their identity, storage
address and torch version counter (which every in-place write through torch bumps: optimizer
steps, `load_state_dict`, `copy_`). `sync()` re-merges exactly the tensors whose stamp changed,
so checking costs a few milliseconds and a train step re-merges only the LoRA layers. Writes that
bypass the version counter (`param.data.copy_(...)`, numpy views) are not seen: call
`sync(force=True)` after those.

Supported: LoRA on `nn.Linear` and `nn.Embedding` layers (what `lora.py` attaches), plus
`modules_to_save`. DoRA, LoRA biases, LoRA variants, adapters merged into the base weights,
trainable tokens and other peft tuners raise `UnsupportedAdapterError` (serve through peft).
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from art_core.engine.torch.decode_step import (
    fuse_projections,
    pack_weights,
)
from art_core.models.hardware import cpu_bf16_pays

logger = logging.getLogger(__name__)

Stamp = tuple[Any, ...]


class UnsupportedAdapterError(ValueError):
    """The adapter cannot be merged into a plain copy of the model (serve it through peft instead)."""


@dataclass(eq=False)
class _Entry:
    """One tensor of the serving model and where its value comes from."""

    dest: torch.Tensor
    """A parameter or buffer of the serving model."""
    source: torch.Tensor
    """The matching base tensor of the source model."""
    lora: Any | None
    """The peft LoRA layer whose delta for the adapter is added to `source` (weights only)."""
    stamp: Stamp | None = None
    """`_stamp` of the sources when `dest` was last written."""


BASE_TARGET = "__base__"
"""The `serving_copy` target that means the base model (peft's own name for "no adapter")."""


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are the fast choice on `device`: CUDA, or a CPU with native bf16 where a
    bf16 matmul measures faster than a float32 one (`hardware.cpu_bf16_pays`)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and cpu_bf16_pays()


def peft_model_of(model: nn.Module) -> bool:
    """Whether `model` is a peft `PeftModel` (without importing peft when it was never imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model inside a `PeftModel` (peft's layers injected into it), or `model` itself."""
    return model.get_base_model() if peft_model_of(model) else model  # type: ignore[operator]


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


class MergedWeights:
    """A plain copy of `model` with `adapter` merged in (None: the base weights), in `dtype`.

    `model` is a transformers model or a peft `PeftModel` around one. The copy is built at once
    (a skeleton of the same class, no weight initialisation, then every tensor copied): about
    0.2 s for SmolLM2-135M; a full re-merge takes ~0.15 s. It never changes the source model.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: str | None,
        dtype: torch.dtype,
        *,
        pack: bool | Literal["head"] | None = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"the serving dtype must be a floating-point dtype, got {dtype}")
        self.adapter = adapter
        self.dtype = dtype
        self.model = skeleton(base_model_of(model), dtype)
        fuse_projections(self.model)  # before the merge map: it must point at the fused buffers
        pack_weights(self.model, pack)
        self._structure: tuple[Any, ...] | None = None
        self._entries: dict[str, _Entry] = {}
        self.merges = 0
        """How many times `sync` wrote at least one tensor."""
        self.merge_seconds = 0.0
        """Wall seconds of those syncs, summed (`EngineStats.merge_seconds`)."""
        self.shared_bytes = 0
        """Bytes of tensors the copy shares with the source model instead of copying (no LoRA on
        them and already in `dtype`: embeddings, norms, a head without an adapter)."""
        self.sync(model)

    def sync(self, model: nn.Module, force: bool = False, base: bool = False) -> int:
        """Bring the copy up to date with `model`'s current weights; returns how many tensors changed.

        Only tensors whose sources changed are rewritten, unless `force` (which rewrites the base
        weights' merged values too: `base` adds nothing here). Raises UnsupportedAdapterError if the
        adapter is gone or cannot be merged.
        """
        started = time.perf_counter()
        structure = structure_key(model)
        if structure != self._structure:
            self._entries = self._share(self._map(model))
            self._structure = structure
        written = 0
        with torch.no_grad():
            for entry in self._entries.values():
                stamp = _stamp(entry, self.adapter)
                if force or stamp != entry.stamp:
                    _write(entry, self.adapter)
                    entry.stamp = stamp
                    written += 1
        if written:
            seconds = time.perf_counter() - started
            self.merges += 1
            self.merge_seconds += seconds
            logger.debug("merged %d tensors of adapter %s in %.3fs", written, self.adapter, seconds)
        return written

    def stale(self, model: nn.Module) -> bool:
        """Whether `sync` would rewrite anything (`model`'s weights changed through torch since the
        last sync); writes nothing. About a millisecond for SmolLM2's ~270 tensors."""
        if structure_key(model) != self._structure:
            return True
        return any(_stamp(entry, self.adapter) != entry.stamp for entry in self._entries.values())

    def _share(self, entries: dict[str, _Entry]) -> dict[str, _Entry]:
        """Point the copy at the source's own tensor wherever the value would be a plain copy (no
        LoRA delta, same dtype, shape and device); returns the entries still to be written by `sync`.

        Such tensors (SmolLM2: the tied embeddings and head, 113 MB in float32, and the norms) then
        exist once; a later in-place write to the source is seen at once. Tied tensors of the copy
        are swapped together.
        """
        swap: dict[int, torch.Tensor] = {}
        kept: dict[str, _Entry] = {}
        for key, entry in entries.items():
            dest, source = entry.dest, entry.source
            plain = entry.lora is None and dest.dtype == source.dtype and dest.device == source.device
            if plain and _whole(dest) and source.is_contiguous() and dest is not source:
                swap[id(dest)] = source
            elif dest is not source:
                kept[key] = entry
        swap_tensors(self.model, swap)
        self.shared_bytes += sum(
            t.untyped_storage().nbytes() for t in {id(t): t for t in swap.values()}.values()
        )
        return kept

    def _map(self, model: nn.Module) -> dict[str, _Entry]:
        """Pair every tensor of the serving model with its source (and LoRA layer) in `model`."""
        if self.adapter is not None and (
            not peft_model_of(model) or self.adapter not in model.peft_config  # type: ignore[operator]
        ):
            raise UnsupportedAdapterError(f"the model has no adapter {self.adapter!r} to merge")
        source_root = base_model_of(model)
        old = self._entries
        entries: dict[str, _Entry] = {}
        seen: dict[int, _Entry] = {}  # tied tensors (the head and the embeddings) are written once
        for path, module in self.model.named_modules(remove_duplicate=False):
            tensors = [
                *module.named_parameters(recurse=False, remove_duplicate=False),
                *module.named_buffers(recurse=False, remove_duplicate=False),
            ]
            if not tensors:
                continue
            source_module, lora = resolve_base(source_root, path, self.adapter)
            for name, dest in tensors:
                source = getattr(source_module, name, None)
                if not isinstance(source, torch.Tensor) or source.shape != dest.shape:
                    raise UnsupportedAdapterError(
                        f"cannot copy {path}.{name}: the source model has no tensor of shape "
                        f"{tuple(dest.shape)} there (a model class this copy does not understand)"
                    )
                entry = _Entry(dest, source, lora if name == "weight" else None)
                twin = seen.setdefault(id(dest), entry)
                if twin is not entry:
                    if twin.source is not source or twin.lora is not entry.lora:
                        raise UnsupportedAdapterError(
                            f"{path}.{name} is tied to another tensor whose source differs (e.g. LoRA on "
                            "tied embeddings, which peft applies to one of them only)"
                        )
                    continue
                key = f"{path}.{name}"
                previous = old.get(key)
                if previous is not None and previous.source is source and previous.lora is entry.lora:
                    entry.stamp = previous.stamp
                entries[key] = entry
        return entries


def _whole(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is all of its storage (not a view into a shared buffer, such as the fused
    q/k/v bias that `fuse_projections` made: that buffer must keep being written)."""
    return (
        tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def skeleton(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An uninitialised model of `base`'s class and config in `dtype`, in eval mode, without grads."""
    from transformers.initialization import no_init_weights

    from_config = getattr(type(base), "_from_config", None)
    if from_config is None:
        raise UnsupportedAdapterError(f"{type(base).__name__} is not a transformers model")
    with no_init_weights():
        empty = from_config(copy.deepcopy(base.config), dtype=dtype)  # the copy: it sets config.dtype
    if hasattr(empty, "tie_weights"):
        empty.tie_weights()
    if hasattr(base, "generation_config"):
        empty.generation_config = copy.deepcopy(base.generation_config)
    device = next(base.parameters()).device
    empty.to(device)
    empty.eval()
    empty.requires_grad_(False)
    return empty


def resolve_base(root: nn.Module, path: str, adapter: str | None) -> tuple[nn.Module, Any | None]:
    """The module of `root` at `path` seen without peft: its base layer, and the LoRA layer wrapping it."""
    module = _unwrap(root, adapter)[0]
    lora = None
    for part in path.split(".") if path else []:
        if lora is not None:
            raise UnsupportedAdapterError(f"a LoRA layer wraps a module with children at {path}")
        module, lora = _unwrap(getattr(module, part), adapter)
    return module, lora


def _unwrap(module: nn.Module, adapter: str | None) -> tuple[nn.Module, Any | None]:
    """Strip peft wrappers from `module`: (the plain module, the LoRA layer holding `adapter`'s delta)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    lora = None
    while True:
        if isinstance(module, ModulesToSaveWrapper):
            inner = module.modules_to_save
            module = inner[adapter] if adapter is not None and adapter in inner else module.original_module
        elif isinstance(module, TrainableTokensWrapper):
            if adapter is not None:
                raise UnsupportedAdapterError("trainable tokens cannot be merged into a serving copy")
            module = module.original_module
        elif isinstance(module, BaseTunerLayer):
            if getattr(module, "merged", False):
                raise UnsupportedAdapterError("an adapter is merged into the base weights (unmerge it first)")
            if not isinstance(module, LoraLayer):
                if adapter is not None and adapter in getattr(module, "active_adapters", ()):
                    raise UnsupportedAdapterError(f"{type(module).__name__} is not a LoRA layer")
            elif adapter is not None and (adapter in module.lora_A or adapter in module.lora_embedding_A):
                check_plain_lora(module, adapter)
                lora = module
            module = module.base_layer  # type: ignore[assignment]
        else:
            return module, lora


def check_plain_lora(layer: Any, adapter: str) -> None:
    from peft.tuners.lora import layer as lora_layers

    if not isinstance(layer, lora_layers.Linear | lora_layers.Embedding):
        raise UnsupportedAdapterError(f"LoRA on {type(layer).__name__} layers is not supported")
    for flag in ("use_dora", "lora_bias"):
        if getattr(layer, flag, {}).get(adapter):
            raise UnsupportedAdapterError(f"adapter {adapter!r} uses {flag}, which this copy cannot merge")
    if adapter in getattr(layer, "lora_variant", {}):
        raise UnsupportedAdapterError(f"adapter {adapter!r} is a LoRA variant, which this copy cannot merge")


def lora_tensors(layer: Any, adapter: str) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if container is None or adapter not in container:
            continue
        item = container[adapter]
        tensors.extend(item.parameters() if isinstance(item, nn.Module) else [item])
    return tensors


def tensor_stamp(tensor: torch.Tensor) -> Stamp:
    return (id(tensor), tensor.data_ptr(), tensor._version)


def _stamp(entry: _Entry, adapter: str | None) -> Stamp:
    """What `dest` depends on: source tensors' identity, storage and version, and the LoRA scale."""
    stamp = tensor_stamp(entry.source)
    if entry.lora is not None and adapter is not None:
        stamp += (entry.lora.scaling.get(adapter),)
        for tensor in lora_tensors(entry.lora, adapter):
            stamp += tensor_stamp(tensor)
    return stamp


def _write(entry: _Entry, adapter: str | None) -> None:
    """`dest = cast(source + delta)` for a merged weight, else `dest = cast(source)`. A float32 copy
    of a plain LoRA `Linear` gets `source`, then `B @ A` added in place with `scaling` as the
    addition's alpha: one [out, in] temporary instead of `get_delta_weight`'s two and the sum's.
    Not `addmm_` into `dest`: BLAS may round `alpha * (B @ A) + dest` differently at another thread
    count, and the copy is built in one thread (a restart) and re-merged in another (the engine's
    worker), which must give the same bits."""
    lora, dest = entry.lora, entry.dest
    if (
        lora is not None
        and adapter is not None
        and dest.dtype == torch.float32
        and _plain_linear(lora, adapter)
    ):
        down, up = lora.lora_A[adapter].weight, lora.lora_B[adapter].weight
        dest.copy_(entry.source).add_(torch.mm(up.float(), down.float()), alpha=lora.scaling[adapter])
        return
    dest.copy_(_merged_value(entry, adapter))


def _plain_linear(lora: Any, adapter: str) -> bool:
    """A peft LoRA `Linear` whose delta is `scaling * B @ A` laid out as the weight (not fan-in-fan-out)."""
    from peft.tuners.lora import Linear

    return isinstance(lora, Linear) and adapter in lora.lora_A and not lora.fan_in_fan_out


def _merged_value(entry: _Entry, adapter: str | None) -> torch.Tensor:
    """`source + delta` in float32 (for a merged weight), else `source`; copy_ casts it into `dest`."""
    if entry.lora is None or adapter is None:
        return entry.source
    delta = entry.lora.get_delta_weight(adapter)
    return entry.source.float() + delta.float()


def swap_tensors(model: nn.Module, swap: dict[int, torch.Tensor]) -> None:
    """Replace each parameter or buffer of `model` whose id is a key of `swap` by its value there
    (tied tensors together: every module holding it); a parameter stays a parameter."""
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and id(tensor) in swap:
                    source = swap[id(tensor)]
                    if isinstance(tensor, nn.Parameter) and not isinstance(source, nn.Parameter):
                        source = nn.Parameter(source, requires_grad=False)
                    store[name] = source  # type: ignore[assignment]  # a buffer store holds plain tensors


def structure_key(model: nn.Module) -> tuple[Any, ...]:
    """Changes when the module tree may have changed (a model wrapped by peft, adapters added or removed)."""
    adapters = tuple(model.peft_config) if peft_model_of(model) else ()  # type: ignore[arg-type]
    return (id(model), adapters)
