"""Tiny random models of each family ART users train, built locally in about a second each.

`build_family(family, folder)` writes a Hugging Face folder (random weights from the family's
transformers config class, init range 0.1, seeded) with a tokenizer carrying that family's special
tokens and official chat template (`tests.family_templates`). The tokenizer is our tiny byte-level
BPE (`models.loading`'s, trained on stdlib modules) plus the family's turn and tool tokens as
special added tokens, so each family's template renders and tokenizes as it would on the real
model, without any download.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken

from art_core.models.loading import _tiny_tokenizer
from tests import family_templates as templates

_SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.1,
    tie_word_embeddings=False,
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture of the matrix: how to build it and what the server should make of it."""

    name: str
    """Test id, e.g. "gemma3"."""
    config: Callable[[dict[str, Any]], Any]
    """The transformers config of a tiny model, from shared sizes and token ids."""
    template: str
    """The family's chat template (tests.family_templates)."""
    special: tuple[str, ...]
    """Its turn and tool tokens, added as special tokens."""
    bos: str | None
    """Its bos token, when its template writes one."""
    eos: str | None = None
    """Its eos token, when its template writes it (Mistral's `</s>`)."""
    tool_format: str = "hermes"
    """The `ToolFormat.name` the server must detect."""
    in_content: bool = False
    """Whether its template has no tool support (tools written into plain messages)."""
    fast: bool = False
    """Whether the engine's lean decode step and the trainer's packed forward run it."""


def _llama(kw: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _qwen2(kw: dict[str, Any]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**kw)


def _qwen3(kw: dict[str, Any]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def _qwen3_moe(kw: dict[str, Any]) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _gemma3(kw: dict[str, Any]) -> Any:
    from transformers import Gemma3TextConfig

    # One sliding-window layer (window 8: prompts are longer, so it truncates) and one global one.
    return Gemma3TextConfig(
        **kw, layer_types=["sliding_attention", "full_attention"], sliding_window=8, query_pre_attn_scalar=16
    )


def _mistral(kw: dict[str, Any]) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**kw, sliding_window=None)


def _phi3(kw: dict[str, Any]) -> Any:
    from transformers import Phi3Config

    return Phi3Config(**kw)


_LLAMA_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>")  # fmt: skip
_MISTRAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]")  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    Family("llama", _llama, templates.LLAMA31, _LLAMA_TOKENS, "<|begin_of_text|>", tool_format="llama3_json",
           fast=True),
    Family("qwen2", _qwen2, templates.QWEN25, (), None, fast=True),
    Family("qwen3", _qwen3, templates.QWEN3, (), None, fast=True),
    Family("gemma3", _gemma3, templates.GEMMA3, ("<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>",
           in_content=True, fast=True),
    Family("mistral", _mistral, templates.MISTRAL_V03, _MISTRAL_TOKENS, "<s>", eos="</s>", tool_format="mistral",
           fast=True),
    Family("phi3", _phi3, templates.PHI3, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), None,
           in_content=True),
    Family("qwen3_moe", _qwen3_moe, templates.QWEN3, (), None),
)  # fmt: skip
"""The matrix: Llama 3.1, Qwen2.5, Qwen3, Gemma 3 (text), Mistral v0.3, Phi-3 and Qwen3-MoE."""


@functools.cache
def _base_tokenizer() -> Any:
    return _tiny_tokenizer()  # trained once per process (~1 s), copied per family


def family_tokenizer(family: Family) -> Any:
    """The tiny tokenizer with `family`'s special tokens, bos and chat template."""
    tokenizer = copy.deepcopy(_base_tokenizer())
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    if family.bos is not None:
        tokenizer.bos_token = family.bos
    if family.eos is not None:
        tokenizer.eos_token = family.eos
    tokenizer.chat_template = family.template
    return tokenizer


def build_family(family: Family, folder: Path, seed: int = 0) -> Path:
    """Write a tiny random `family` model and its tokenizer to `folder` (a model folder `load_model` takes)."""
    from transformers import AutoModelForCausalLM

    tokenizer = family_tokenizer(family)
    ids = dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config = family.config({**_SIZES, **ids})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
