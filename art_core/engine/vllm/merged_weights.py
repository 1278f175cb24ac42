"""The vLLM worker side of `weight_sync="merged"`: merge a LoRA checkpoint into the served weights.

`VLLMEngine` names `MergedWeightsLoader` as vLLM's `worker_extension_cls` in merged mode, so vLLM
mixes it into its worker class in the engine-core process (every worker, with tensor parallelism).
`VLLMEngine.load_merged` then calls `art_load_merged(adapter_dir, base_dir)` there through
`collective_rpc`: only two paths cross the process boundary. The worker computes the merged tensors
itself (`merge.merged_tensors`: the LoRA folder's A/B and the base folder's weights, read from disk,
so a second load replaces the first instead of adding to it) and hands them to vLLM's in-place
reload (`Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`). That path maps
checkpoint names onto vLLM's fused layers and reruns each reloaded layer's weight processing (on
CPU the linear layers keep only a repacked oneDNN copy of their weights, which a plain
`model.load_weights` could not write into). A fused layer (qkv_proj, gate_up_proj) is reloaded
whole: its members the LoRA does not target come from the base unchanged.

Imports vLLM and torch only inside the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""vLLM's in-place reload warns for each layer it did not get weights for (all but the merged ones)."""


class MergedWeightsLoader:
    """Mixed into vLLM's worker (`worker_extension_cls`) by `VLLMEngine` with `weight_sync="merged"`."""

    model_runner: Any  # provided by vLLM's worker

    def art_load_merged(self, adapter_dir: str, base_dir: str) -> dict[str, float]:
        """Serve `base_dir`'s weights with the LoRA in `adapter_dir` merged in; returns counts and seconds."""
        from art_core.engine.vllm.merge import merged_tensors

        started = time.perf_counter()
        model = self.model_runner.get_model()
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        loaded = {"tensors": 0, "elements": 0}

        def counted() -> Any:
            tensors = merged_tensors(
                adapter_dir,
                base_dir,
                dtype=self.model_runner.model_config.dtype,
                device=self.model_runner.device,
                expand=lambda module: fused_siblings(packed, module),
            )
            for name, tensor in tensors:
                loaded["tensors"] += 1
                loaded["elements"] += tensor.numel()
                yield name, tensor

        with _quiet(_RELOAD_LOGGERS):  # they warn about every layer left as it was, which is the point here
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {**{k: float(v) for k, v in loaded.items()}, "seconds": time.perf_counter() - started}


def fused_siblings(packed_modules: dict[str, list[str]], module: str) -> list[str]:
    """`module` and the checkpoint modules vLLM fuses with it into one layer (by the model's
    `packed_modules_mapping`: `...self_attn.q_proj` -> q_proj, k_proj, v_proj of that attention)."""
    prefix, _, leaf = module.rpartition(".")
    for members in packed_modules.values():
        if leaf in members:
            return [f"{prefix}.{m}" if prefix else m for m in members]
    return [module]


@contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    """Errors only from the loggers `names` inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
