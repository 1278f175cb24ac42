"""Small random models built in the tests (beside conftest's `tiny_model`, a Qwen2)."""

from __future__ import annotations

import pytest
import torch

from art_core.engine.torch.decoding import DecodeBatch


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    """A random Llama (grouped-query attention: 4 heads on 2 kv heads), seeded, init range 0.1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def tiny_qwen3(layers: int = 2) -> torch.nn.Module:
    """A random Qwen3 (q/k norms; grouped-query attention: 4 heads on 2 kv heads), seeded, init range 0.1.

    Its q/k norm weights are randomised too (they start at 1), so a missed norm shows."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


def tiny_mistral(layers: int = 2, window: int | None = None) -> torch.nn.Module:
    """A random Mistral (grouped-query attention: 4 heads on 2 kv heads), seeded, init range 0.1;
    `window`: its sliding window over every layer (None: none, Llama's math)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1, sliding_window=window,
    )  # fmt: skip
    torch.manual_seed(0)
    return MistralForCausalLM(config)


def tiny_gemma3(layers: int = 2, window: int = 4) -> torch.nn.Module:
    """A random Gemma 3 text model: sliding-window (`window`) and global layers alternating, q/k norms
    and every other norm randomised (Gemma's norms scale by 1 + weight, which starts at 0)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    config = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
        layer_types=kinds, sliding_window=window, query_pre_attn_scalar=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    return model


def record_prefills(patch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the input shape of every multi-token forward (a prefill) of `DecodeBatch`."""
    shapes: list[tuple[int, ...]] = []
    forward = DecodeBatch.forward

    def recording(
        batch: DecodeBatch, input_ids: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        if input_ids.shape[1] > 1:
            shapes.append(tuple(input_ids.shape))
        return forward(batch, input_ids, *args, **kwargs)  # type: ignore[arg-type]

    patch.setattr(DecodeBatch, "forward", recording)
    return shapes
