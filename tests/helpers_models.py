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
