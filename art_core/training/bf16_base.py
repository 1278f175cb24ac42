"""bfloat16 copies of the frozen base weights of LoRA layers: the "bf16" matmul precision on CPU, made explicit.

`matmul_precision="bf16"` means bf16 matmul inputs with float32 accumulation. torch asks oneDNN for
that with `torch.backends.mkldnn.matmul.fp32_precision = "bf16"` on float32 tensors, but whether
oneDNN then rounds depends on the CPU: with AMX it does; on a CPU with AVX512-BF16 and no AMX
(AMD EPYC), torch 2.13 computes the same float32 products as "ieee" (errors of float32 size, and
half the speed of a matmul on bf16 tensors: [545, 576] x [576, 1536] in 5.7 ms against 3.0 ms).

`Bf16BaseWeights` therefore computes the frozen base `nn.Linear` of every plain LoRA layer (q/k/v/o,
gate/up/down: almost all of a step's FLOPs) on bf16 tensors itself: a bf16 copy of each weight,
made once and kept while the weight is unchanged, and the activations cast to bf16 on the way in
and back to float32 on the way out (as autocast does). The same rounding on every CPU with native
bf16, and no per-call conversion of the weight. The LoRA weights, their gradients and the optimizer
stay float32; only the frozen base's inputs and outputs are rounded.

Cost: the copies hold half the LoRA layers' base weights again (SmolLM2-135M: 212 MB).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from art_core.training.packed_forward import is_plain_lora

Stamp = tuple[int, int]
"""(storage address, torch version counter) of a base weight when its copy was made."""


class Bf16BaseWeights:
    """The bf16 copies of a model's frozen LoRA base weights, and the forwards that use them."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[Stamp, Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold."""
        return sum(copy.numel() * copy.element_size() for _, copy in self._copies.values())

    def weight(self, linear: nn.Linear) -> Tensor:
        """The bf16 copy of `linear.weight`, made again when the weight changed since (through torch)."""
        weight = linear.weight
        stamp = (weight.data_ptr(), weight._version)
        cached = self._copies.get(id(linear))
        if cached is None or cached[0] != stamp:
            cached = (stamp, weight.detach().to(torch.bfloat16))
            self._copies[id(linear)] = cached
        return cached[1]

    @contextlib.contextmanager
    def applied(self, model: nn.Module, adapter_name: str) -> Iterator[int]:
        """Within the block, the frozen float32 base `nn.Linear` of each of `adapter_name`'s plain
        LoRA layers computes on bf16 tensors; yields how many layers do."""
        loras: list[Any] = [layer for layer in model.modules() if is_plain_lora(layer, adapter_name)]
        linears: list[nn.Linear] = [
            lora.base_layer for lora in loras if _frozen_float32_linear(lora.base_layer)
        ]
        for linear in linears:
            linear.forward = _bf16_forward(linear, self.weight(linear))  # type: ignore[method-assign]
        try:
            yield len(linears)
        finally:
            for linear in linears:
                del linear.forward


def _frozen_float32_linear(module: Any) -> bool:
    """A plain `nn.Linear` (not one that FSDP or anyone else subclassed) with a frozen float32 weight."""
    return (
        type(module) is nn.Linear
        and type(module.weight) is nn.Parameter
        and not module.weight.requires_grad
        and module.weight.dtype == torch.float32
        and "forward" not in vars(module)
    )


def _bf16_forward(linear: nn.Linear, weight: Tensor) -> Any:
    bias = linear.bias

    def forward(x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            return F.linear(x, linear.weight, bias)
        out = F.linear(x.to(torch.bfloat16), weight).to(torch.float32)
        # In place on a fresh tensor (the cast's backward does not need it): no copy of the output.
        return out if bias is None else out.add_(bias)

    return forward
