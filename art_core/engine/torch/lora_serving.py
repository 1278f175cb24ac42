"""An unmerged serving copy: the trainer's own base weights, no merged copy of them, the LoRA update live.

`MergedWeights` keeps a second model whose weights are `W + s B A`: in a serving dtype other than
the trainer's (bf16 where it pays) that copy is needed anyway, and the merge is free. Where the
serving dtype *is* the trainer's (float32 on CPUs where bf16 does not pay) the merged copy is 425 MB
held beside the same base weights (SmolLM2-135M), rewritten after every train step, and packed
again for the decode step on top of that (`decode_step.pack_weights`).

`UnmergedWeights` serves the same adapter without a merged copy. Its model is a plain transformers
model (a skeleton of the trainer's class) whose every parameter and buffer *is* the trainer's base
tensor (shared, not copied), and whose LoRA-adapted projections are `UnmergedLinear`s: the base
layer's weight plus a `decode_step.LowRank` update that holds copies of the adapter's A and scaled
B (a few hundred KB), refreshed by `sync()` when the trainer changed them. Where a model has no
`decode_step` (or no `prefill_step`), transformers' forward runs through these modules (base
product plus update). The decode and prefill steps multiply
by oneDNN-packed copies (q/k/v and gate/up stacked, as the merged copy fuses them), which take the
merged copy's place in memory: in float32 with the update merged into them
(`decode_step.merges_into_pack`: two small matmuls a projection fewer per step, ~10% of a 32-row
step on an AVX2 CPU), so `sync()` merges each changed update into its packed copy, in the same
buffer (~0.15 s for SmolLM2-135M on 2 AVX2 cores, once per train step: `packed_layout`); in
bf16 the packs are the base weights' alone, made once, and the update is added beside them.

Same staleness contract as `MergedWeights`: `sync()` compares the version counters of the
adapter's tensors (and their scale) and refreshes the updates that changed; the trainer changes
weights only while the engine is paused. A packed copy also records the update it holds, so a
decode step never multiplies by an update older than the `LowRank`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from art_core.engine.torch.decode_step import (
    GATE_UP,
    LOW_RANK,
    PACKED_WEIGHTS,
    QKV,
    LowRank,
    pack_weights,
    refresh_packs,
    supports_decode_step,
)
from art_core.engine.torch.serving_weights import (
    Stamp,
    UnsupportedAdapterError,
    base_model_of,
    check_plain_lora,
    lora_tensors,
    model_dtype,
    peft_model_of,
    resolve_base,
    skeleton,
    structure_key,
    swap_tensors,
    tensor_stamp,
)

logger = logging.getLogger(__name__)


class UnmergedLinear(nn.Module):
    """A linear layer whose weight and bias are another model's (shared) plus a `LowRank` update."""

    def __init__(self, base: nn.Linear, low_rank: LowRank) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        setattr(self, LOW_RANK, low_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low_rank: LowRank = getattr(self, LOW_RANK)
        return low_rank.add_to(F.linear(x, self.weight, self.bias), x)


class _Update:
    """Where one `LowRank` comes from: the LoRA layers of its projections (None: no LoRA there).

    `parts`: for a fused group, each projection's own `LowRank` (None where it has no LoRA), which
    `refresh` points at views of the stacked tensors, so a group's A and B are copied once, not
    once for the decode step and again for the modules (what transformers' forward runs)."""

    def __init__(
        self,
        paths: list[str],
        loras: list[Any | None],
        outs: list[int],
        low_rank: LowRank,
        parts: Sequence[LowRank | None] = (),
    ) -> None:
        self.paths, self.loras, self.outs, self.low_rank = paths, loras, outs, low_rank
        self.parts = list(parts)
        self.stamp: Stamp | None = None

    def current(self, adapter: str) -> Stamp:
        stamp: Stamp = ()
        for lora in self.loras:
            if lora is not None:
                stamp += (lora.scaling.get(adapter),)
                stamp += tuple(tensor_stamp(t) for t in lora_tensors(lora, adapter))
        return stamp

    def refresh(self, adapter: str) -> None:
        """`down_t` = the A matrices stacked, transposed; `up_t` = each scaled B, transposed, on the
        block diagonal (the scale applied in float32, then cast to the base weights' dtype)."""
        dtype = self.low_rank.down_t.dtype
        downs = [lora.lora_A[adapter].weight.detach() for lora in self.loras if lora is not None]
        down_t = torch.cat(downs).to(dtype).t().contiguous()
        up_t = torch.zeros((down_t.shape[1], sum(self.outs)), dtype=dtype, device=down_t.device)
        rank = out = 0
        for index, (lora, width) in enumerate(zip(self.loras, self.outs, strict=True)):
            if lora is not None:
                block = lora.lora_B[adapter].weight.detach().float() * lora.scaling[adapter]
                up_t[rank : rank + block.shape[1], out : out + width] = block.t()
                part = self.parts[index] if self.parts else None
                if part is not None:
                    part.down_t = down_t[:, rank : rank + block.shape[1]]
                    part.up_t = up_t[rank : rank + block.shape[1], out : out + width]
                rank += block.shape[1]
            out += width
        self.low_rank.down_t, self.low_rank.up_t = down_t, up_t


class UnmergedWeights:
    """`model`'s base weights (shared) plus `adapter`'s LoRA update, unmerged; see the module docstring.

    Serves in the model's own dtype. Raises UnsupportedAdapterError where it cannot serve the
    adapter exactly (then use `MergedWeights`): LoRA on anything but a plain linear layer (DoRA,
    LoRA biases, variants, embeddings), tensors of more than one dtype, or an architecture
    `decode_step` does not run.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: str,
        *,
        pack: bool | Literal["head"] | None = None,
    ) -> None:
        if not peft_model_of(model) or adapter not in model.peft_config:  # type: ignore[operator]
            raise UnsupportedAdapterError(f"the model has no adapter {adapter!r} to serve")
        self.adapter = adapter
        self.dtype = model_dtype(model)
        source_root = base_model_of(model)
        self.model: Any = skeleton(source_root, self.dtype)
        if not supports_decode_step(self.model):
            raise UnsupportedAdapterError(f"{type(self.model).__name__} has no unmerged decode step")
        self._updates: list[_Update] = []
        self._loras: dict[int, Any] = {}  # id of a projection's LowRank -> its LoRA layer
        self._biases: list[tuple[tuple[torch.Tensor, ...], torch.Tensor, Stamp]] = []
        """Fused groups' stacked biases: (the base biases, their stack, the stamp it was made at)."""
        self._share(source_root)
        self.model.eval()
        self.packed = pack_weights(self.model, None if pack == "head" else pack)
        """Whether decode steps multiply by packed copies of the base weights (else plain `F.linear`)."""
        self._fuse()
        self._structure = structure_key(model)
        self.merges = 0
        """How many times `sync` refreshed at least one update (the prefix cache's weight version)."""
        self.merge_seconds = 0.0
        """Wall seconds of those syncs, summed: the refreshes and the packs' merges
        (`EngineStats.merge_seconds`)."""
        self.shared_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        """Bytes of the trainer's tensors the copy serves from (all of its parameters)."""
        self.sync(model)

    def sync(self, model: nn.Module, force: bool = False, base: bool = False) -> int:
        """Refresh the LoRA updates whose adapter tensors changed (all if `force`); returns how many.

        The base weights are the model's own, so they are always current; their packed copies
        follow every write that bumps a version counter. `base`: they may have been written
        around the counters (`param.data.copy_`; the engine's `weights_updated()`), so the packed
        copies are dropped and made again on the next decode step (~0.5 s for SmolLM2-135M).
        Raises UnsupportedAdapterError if the adapter is gone or its LoRA layers were replaced."""
        if structure_key(model) != self._structure:
            self._remap(model)
        if base:
            packs = getattr(self.model, PACKED_WEIGHTS, None)
            if packs is not None:
                packs.clear()
            force = True
        started = time.perf_counter()
        written = 0
        with torch.no_grad():
            # base biases are frozen under LoRA; a user may still write them
            for index, (sources, stacked, stamp) in enumerate(self._biases):
                current = tuple(tensor_stamp(b) for b in sources)
                if force or current != stamp:
                    stacked.copy_(torch.cat(sources))
                    self._biases[index] = (sources, stacked, current)
                    written += 1
            for update in self._updates:
                stamp = update.current(self.adapter)
                if force or stamp != update.stamp:
                    update.refresh(self.adapter)
                    update.stamp = stamp
                    written += 1
        repacked = refresh_packs(self.model) if written and self.packed else 0
        if written:
            seconds = time.perf_counter() - started
            self.merges += 1
            self.merge_seconds += seconds
            logger.debug(
                "refreshed %d LoRA updates (%d packed weights merged) in %.3fs", written, repacked, seconds
            )
        return written

    def stale(self, model: nn.Module) -> bool:
        """Whether `sync` would refresh anything; changes nothing."""
        if structure_key(model) != self._structure:
            return True
        if any(tuple(tensor_stamp(b) for b in sources) != stamp for sources, _, stamp in self._biases):
            return True
        return any(update.current(self.adapter) != update.stamp for update in self._updates)

    def _remap(self, model: nn.Module) -> None:
        """After adapters were added or removed: check that the served one's LoRA layers are the
        ones this copy reads (peft adds other adapters beside them, in the same layers)."""
        if not peft_model_of(model) or self.adapter not in model.peft_config:  # type: ignore[operator]
            raise UnsupportedAdapterError(f"the model has no adapter {self.adapter!r} to serve any more")
        root = base_model_of(model)
        for update in self._updates:
            for path, lora in zip(update.paths, update.loras, strict=True):
                if lora is not None and resolve_base(root, path, self.adapter)[1] is not lora:
                    raise UnsupportedAdapterError(
                        f"the LoRA layer at {path} was replaced since the copy was made"
                    )
        self._structure = structure_key(model)

    def _share(self, source_root: nn.Module) -> None:
        """Point every tensor of the skeleton at the source's base tensor, and replace each linear
        layer the adapter adapts by an `UnmergedLinear` over its base."""
        swap: dict[int, torch.Tensor] = {}
        adapted: list[tuple[str, nn.Linear, Any]] = []
        for path, module in self.model.named_modules(remove_duplicate=False):
            source_module, lora = resolve_base(source_root, path, self.adapter)
            for name, dest in [
                *module.named_parameters(recurse=False, remove_duplicate=False),
                *module.named_buffers(recurse=False, remove_duplicate=False),
            ]:
                source = getattr(source_module, name, None)
                if (
                    not isinstance(source, torch.Tensor)
                    or source.shape != dest.shape
                    or source.dtype != dest.dtype
                ):
                    raise UnsupportedAdapterError(
                        f"cannot serve {path}.{name} from the source model as it is"
                    )
                swap[id(dest)] = source
            if lora is not None:
                check_plain_lora(lora, self.adapter)
                if not isinstance(source_module, nn.Linear) or lora.fan_in_fan_out:
                    raise UnsupportedAdapterError(
                        f"LoRA on {path} ({type(source_module).__name__}) is not a plain linear one"
                    )
                adapted.append((path, source_module, lora))
        swap_tensors(self.model, swap)
        for path, base, lora in adapted:
            parent_path, _, name = path.rpartition(".")
            parent = self.model.get_submodule(parent_path)
            low_rank = self._update([path], [lora], [base.out_features])
            self._loras[id(low_rank)] = lora
            setattr(parent, name, UnmergedLinear(base, low_rank))

    def _update(
        self, paths: list[str], loras: list[Any | None], outs: list[int], parts: Sequence[LowRank | None] = ()
    ) -> LowRank:
        """A new update of `paths`; with `parts` (a fused group's projections' own updates), it
        refreshes them as views of its tensors and they are no longer refreshed by themselves."""
        placeholder = torch.empty(0, dtype=self.dtype, device=next(self.model.parameters()).device)
        update = _Update(paths, loras, outs, LowRank(placeholder, placeholder), parts)
        absorbed = {id(part) for part in parts if part is not None}
        if absorbed:
            self._updates = [u for u in self._updates if id(u.low_rank) not in absorbed]
        self._updates.append(update)
        return update.low_rank

    def _fuse(self) -> None:
        """With packed weights, let `decode_step` run each layer's q/k/v and gate/up as one packed
        matmul plus one stacked update (as `fuse_projections` does for the merged copy), without a
        stacked plain copy of the weights: only the packed layout is made. The projections' own
        updates (transformers' forward runs through their modules) become views of the stacked one."""
        if not self.packed:
            return
        for index, layer in enumerate(self.model.model.layers):
            for owner, names, key in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj"), QKV),
                (layer.mlp, ("gate_proj", "up_proj"), GATE_UP),
            ):
                prefix = f"model.layers.{index}.{'self_attn' if key == QKV else 'mlp'}"
                linears = [getattr(owner, name) for name in names]
                biases = [linear.bias for linear in linears]
                if any(b is not None for b in biases) and not all(b is not None for b in biases):
                    continue  # a mixed group runs as its modules
                bias = None
                if biases[0] is not None:
                    sources = tuple(b for b in biases if b is not None)
                    bias = torch.cat([b.detach() for b in sources])
                    self._biases.append((sources, bias, tuple(tensor_stamp(b) for b in sources)))
                setattr(owner, key, (tuple(linear.weight for linear in linears), bias))
                low_ranks = [getattr(linear, LOW_RANK, None) for linear in linears]
                if any(low_rank is not None for low_rank in low_ranks):
                    loras = [self._loras.get(id(low_rank)) for low_rank in low_ranks]
                    outs = [linear.out_features for linear in linears]
                    paths = [f"{prefix}.{name}" for name in names]
                    setattr(owner, key + "_lora", self._update(paths, loras, outs, parts=low_ranks))
