"""Which serving copy the engine decodes the served adapter on (`serving_copy`): none, a merged one
(`serving_weights.MergedWeights`) or an unmerged one (`lora_serving.UnmergedWeights`)."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from art_core.engine.torch.decode_step import PACKED_HEAD, PACKED_WEIGHTS, packable
from art_core.engine.torch.lora_serving import UnmergedWeights
from art_core.engine.torch.serving_weights import (
    BASE_TARGET,
    MergedWeights,
    UnsupportedAdapterError,
    fast_bf16,
    model_dtype,
    peft_model_of,
)

logger = logging.getLogger(__name__)


def serving_copy(
    model: nn.Module,
    target: str | None,
    dtype: torch.dtype | str,
    *,
    pack: bool | Literal["head"] | None = None,
    unmerged: bool | None = None,
) -> MergedWeights | UnmergedWeights | None:
    """The serving copy that `EngineConfig.serve_adapter` / `serve_dtype` / `serve_unmerged` ask for;
    None: serve `model` itself.

    `target` None is the active adapter of a peft model (the trainer's) or the base of a plain
    one. `dtype` "auto" is bfloat16 for a peft model where bf16 is fast (`fast_bf16`), else the
    model's dtype. A plain model already in the dtype gets no copy; neither does an adapter that
    cannot be merged (logged: its rows then run through peft). `pack`: `EngineConfig.pack_weights`.
    An adapter served in the model's own dtype is served unmerged (`lora_serving.UnmergedWeights`)
    where `unmerged` is True, or None and its base weights are packed; else merged.
    """
    peft = peft_model_of(model)
    if target is None:
        target = str(model.active_adapters[0]) if peft else BASE_TARGET  # type: ignore[index]
    adapter = None if target == BASE_TARGET else target
    if isinstance(dtype, str):
        device = next(model.parameters()).device
        dtype = torch.bfloat16 if peft and fast_bf16(device) else model_dtype(model)
    if not peft and adapter is None and dtype == model_dtype(model):
        return None
    device = next(model.parameters()).device
    packed = packable(dtype, device, None if pack == "head" else pack)
    if unmerged and (adapter is None or dtype != model_dtype(model)):
        logger.warning(
            "serve_unmerged needs an adapter served in the model's own dtype (%s, not %s): serving %s merged",
            model_dtype(model),
            dtype,
            target,
        )
    elif adapter is not None and dtype == model_dtype(model) and (unmerged or (unmerged is None and packed)):
        try:
            unmerged_copy = UnmergedWeights(model, adapter, pack=pack)
        except UnsupportedAdapterError as exc:
            logger.log(
                logging.WARNING if unmerged else logging.INFO,
                "adapter %s served merged, not unmerged: %s",
                target,
                exc,
            )
        else:
            logger.info(
                "serving adapter %s unmerged over the base weights (packed: %s)",
                target,
                unmerged_copy.packed,
            )
            return unmerged_copy
    try:
        merged = MergedWeights(model, adapter, dtype, pack=pack)
    except UnsupportedAdapterError as exc:
        logger.warning("no merged serving copy (its rows run through peft): %s", exc)
        return None
    layout = " (oneDNN-packed matmul weights)" if hasattr(merged.model, PACKED_WEIGHTS) else ""
    layout = " (oneDNN-packed head)" if hasattr(merged.model, PACKED_HEAD) else layout
    logger.info("serving adapter %s from a merged %s copy%s", target, dtype, layout)
    return merged
