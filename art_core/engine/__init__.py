"""Inference engines: the `Engine` protocol the server calls, and its two implementations.

`protocol` (Engine, Completion), `finish_reason` (FinishReason), `config` (GenerationRequest, EngineConfig, EngineStats), `errors`, `sampling`
(SamplingParams), `grammar` (constrained decoding) and `admission`; `torch/` holds TorchEngine
(continuous batching, prefix cache, merged serving copy) and `vllm/` VLLMEngine.
Lazy: the engines import torch (and vLLM where installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.engine.config import EngineConfig as EngineConfig
    from art_core.engine.config import EngineStats as EngineStats
    from art_core.engine.config import GenerationRequest as GenerationRequest
    from art_core.engine.errors import ContextLengthError as ContextLengthError
    from art_core.engine.errors import EngineClosedError as EngineClosedError
    from art_core.engine.errors import EngineOverloadedError as EngineOverloadedError
    from art_core.engine.errors import InvalidRequestError as InvalidRequestError
    from art_core.engine.errors import UnknownAdapterError as UnknownAdapterError
    from art_core.engine.finish_reason import FinishReason as FinishReason
    from art_core.engine.protocol import Completion as Completion
    from art_core.engine.protocol import Engine as Engine
    from art_core.engine.sampling import SamplingParams as SamplingParams
    from art_core.engine.torch.engine import TorchEngine as TorchEngine
    from art_core.engine.vllm.config import VLLMEngineConfig as VLLMEngineConfig
    from art_core.engine.vllm.engine import VLLMEngine as VLLMEngine

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.engine.protocol": ("Engine", "Completion"),
        "art_core.engine.config": ("GenerationRequest", "EngineConfig", "EngineStats"),
        "art_core.engine.sampling": ("SamplingParams",),
        "art_core.engine.finish_reason": ("FinishReason",),
        "art_core.engine.errors": (
            "InvalidRequestError",
            "ContextLengthError",
            "UnknownAdapterError",
            "EngineClosedError",
            "EngineOverloadedError",
        ),
        "art_core.engine.torch.engine": ("TorchEngine",),
        "art_core.engine.vllm.engine": ("VLLMEngine",),
        "art_core.engine.vllm.config": ("VLLMEngineConfig",),
    },
)
