"""The trainer's forward pass: final hidden states at chosen positions, with a shared prefix run once.

Sequences of one group start with the same prompt. `hidden_states_at` runs such a common prefix
once. Llama and Qwen2 bodies go through `packed_forward` (prefix and rows packed into one pass per
layer); for other models it runs the prefix through transformers (batch 1, with its key/value
cache), expands the cache along the batch without copying, and runs only each row's remaining
tokens on top of it. Autograd sums the gradients that flow back into the shared prefix from every
row, so values and gradients equal the unshared computation up to float rounding. It needs no dropout (one draw for the prefix would replace one per row) and a plain `DynamicCache`;
otherwise every row runs in full.

`fused_lora` swaps, while training, each vanilla peft LoRA `Linear`'s forward for one that adds the
low-rank update with a single `addmm` (base + scaling * (x A^T) B^T) instead of a separate matmul,
multiply and add on the full output: the same function, fewer passes over memory. With a bf16 base
the update is computed in bf16 from the fp32 LoRA weights (as autocast would), rather than casting
the activations to fp32 and back.

The packed forward also runs the tokens that only the rows of one group share (the group's
prompt past the common prefix) once per group (`packed_forward.TokenTree`), so the trainer packs
whole groups into one micro-batch there; for the transformers path it forms micro-batches within
a group. Left out: sliding-window and static caches, fused attention kernels.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import DynamicLayer

from art_core.training.lora_update import add_lora_update_
from art_core.training.packed_forward import (
    FUSED_FORWARD,
    is_plain_lora,
    packed_hidden_states,
    supports_packed_forward,
)

MIN_SHARED_PREFIX = 4
"""Shortest common prefix (tokens) worth a separate forward pass."""


def cache_argument(decoder: nn.Module) -> str | None:
    """The decoder's keyword for a key/value cache ("cache" in newer transformers); None if it has none."""
    parameters = inspect.signature(decoder.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def has_dropout(model: nn.Module) -> bool:
    """True if any dropout (a module, or the config's attention dropout) is active in training."""
    config = getattr(model, "config", None) or getattr(
        getattr(model, "get_base_model", lambda: None)(), "config", None
    )
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(module, nn.Dropout) and module.p > 0 for module in model.modules())


def shared_prefix_length(input_ids: Tensor, attention_mask: Tensor, minimum: int = MIN_SHARED_PREFIX) -> int:
    """Leading tokens common to every row of [B, T] ids, leaving each row at least one token of its
    own; 0 for a single row or fewer than `minimum` common tokens."""
    if input_ids.shape[0] < 2:
        return 0
    same = ((input_ids == input_ids[:1]) & (attention_mask > 0)).all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    common = min(common, int(attention_mask.sum(dim=1).min()) - 1)
    return common if common >= max(minimum, 1) else 0


def hidden_states_at(
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Tensor,
    prefix: int,
    groups: Tensor | None = None,
) -> tuple[Tensor, int]:
    """[N, H] final hidden states at the true entries of `positions` [B, T] (row-major order), and the
    prefix length actually shared (`prefix`, or 0 when the decoder's cache does not allow it).

    `groups` [B]: row labels whose common tokens past the prefix the packed forward also runs once
    (`packed_forward.TokenTree`); the other paths share the prefix only."""
    if supports_packed_forward(decoder):
        return packed_hidden_states(decoder, input_ids, attention_mask, positions, prefix, groups), prefix
    rows, cols = positions.nonzero(as_tuple=True)
    cache_arg = cache_argument(decoder) if prefix > 0 else None
    if cache_arg is not None:
        shared = decoder(
            input_ids=input_ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix], use_cache=True
        )
        cache = getattr(shared, cache_arg)
        layers = getattr(cache, "layers", None)
        if layers and all(type(layer) is DynamicLayer for layer in layers):
            batch_size, length = input_ids.shape
            for layer in layers:  # the prefix's keys and values, seen by every row without a copy
                layer.keys = layer.keys.expand(batch_size, -1, -1, -1)
                layer.values = layer.values.expand(batch_size, -1, -1, -1)
            rest = decoder(
                input_ids=input_ids[:, prefix:],
                attention_mask=attention_mask,
                use_cache=True,
                **{cache_arg: cache},
            ).last_hidden_state
            table = torch.cat([shared.last_hidden_state[0], rest.reshape(-1, rest.shape[-1])])
            index = torch.where(cols < prefix, cols, prefix + rows * (length - prefix) + cols - prefix)
            return table.index_select(0, index), prefix  # repeated indices: see `packed_hidden_states`
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[rows, cols], 0


def _fused_forward(layer: Any, adapter_name: str) -> Any:
    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if (
            args
            or kwargs
            or layer.disable_adapters
            or layer.merged
            or layer.active_adapters != [adapter_name]
        ):
            return type(layer).forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x)
        # In the activations' dtype, as autocast would: the (fp32) LoRA weights are cast, being tiny,
        # rather than the (bf16) activations.
        lora_a = layer.lora_A[adapter_name].weight.to(x.dtype)
        lora_b = layer.lora_B[adapter_name].weight.to(x.dtype)
        down = F.linear(x, lora_a)
        # In place on the base output (its matmul's backward does not need it): no copy of it.
        flat = result.view(-1, result.shape[-1])
        updated = add_lora_update_(
            flat, down.reshape(-1, down.shape[-1]), lora_b, layer.scaling[adapter_name]
        )
        return updated.view(result.shape)

    setattr(forward, FUSED_FORWARD, True)
    return forward


@contextlib.contextmanager
def training_kernels(model: nn.Module, adapter_name: str) -> Iterator[None]:
    """`fused_lora`, and on CPU the math backend of scaled-dot-product attention: the fused CPU
    kernel's backward is slow on training's short sequences (SmolLM2, 8 x 105 tokens, fp32: 820 ms
    of a 2.5 s step in SDPA, against ~150 ms for the math backend's bmm + softmax)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    attention = sdpa_kernel([SDPBackend.MATH]) if on_cpu else contextlib.nullcontext()
    with fused_lora(model, adapter_name), attention:
        yield


@contextlib.contextmanager
def fused_lora(model: nn.Module, adapter_name: str) -> Iterator[None]:
    """Within the block, `adapter_name`'s plain LoRA layers compute base + update with one addmm."""
    layers = [module for module in model.modules() if is_plain_lora(module, adapter_name)]
    for layer in layers:
        layer.forward = _fused_forward(layer, adapter_name)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
