"""Base models: loading (local path, hub cache, the SmolLM2 GGUF, the tiny random test model) and
the chat template (tool-call format, prompt rendering), the Llama ops our decode step and training
forward share (`llama_ops`: rotary embedding), and the hardware probes (`hardware`: native bf16
and whether it pays, oneDNN bf16 packing) that the engine and the trainer choose their kernels by.

Exports `load_model`, `load_tokenizer`, `LoadedModel`, `resolve_model_path`, `ModelNotFoundError`
and `render_prompt`. Lazy: loading imports transformers and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.models.chat_template import render_prompt as render_prompt
    from art_core.models.loading import LoadedModel as LoadedModel
    from art_core.models.loading import ModelConversionError as ModelConversionError
    from art_core.models.loading import ModelNotFoundError as ModelNotFoundError
    from art_core.models.loading import load_model as load_model
    from art_core.models.loading import load_tokenizer as load_tokenizer
    from art_core.models.loading import resolve_model_path as resolve_model_path

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.models.loading": (
            "LoadedModel",
            "ModelConversionError",
            "ModelNotFoundError",
            "load_model",
            "load_tokenizer",
            "resolve_model_path",
        ),
        "art_core.models.chat_template": ("render_prompt",),
    },
)
