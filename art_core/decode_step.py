"""One decoding step of a Llama-family model, without transformers' per-call machinery.

A decode step feeds one new token per row. transformers' forward spends a good part of such a
step on work that does not depend on the data: building 4-D masks, cache bookkeeping, output
objects, keyword plumbing through every layer. On a 2-core CPU that is ~15% of a step of
SmolLM2-135M at 32 rows. `decode_step` runs the same modules (the model's own projections,
norms, MLPs, rotary embedding and head, so every weight and formula is the model's) and does
the attention itself:

- the padding mask is one boolean [B, 1, 1, L] tensor built once per step;
- grouped-query attention without repeating keys and values: each row's queries are viewed as
  [B, kv_heads, group, head_dim], i.e. the `group` query heads that share a kv head act as the
  "query length" of one SDPA call (there is no causal mask to apply for a single new token).

Supported: `LlamaForCausalLM` and `Qwen2ForCausalLM` with full attention in every layer and no
peft wrapping (the engine's merged serving copy). `supports_decode_step` says whether a model
qualifies; anything else runs transformers' forward. The logits equal transformers' to float
rounding (tests/test_decode_step.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

SUPPORTED_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})


def supports_decode_step(model: Any) -> bool:
    """Whether `decode_step` can run `model` (a plain Llama/Qwen2 causal LM with full attention)."""
    if type(model).__name__ not in SUPPORTED_MODELS:
        return False
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        return False
    body = getattr(model, "model", None)
    return body is not None and hasattr(body, "rotary_emb") and hasattr(body, "layers")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decode_step(
    model: Any, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
) -> torch.Tensor:
    """Logits [B, V] (float32) of one new token per row, appending its keys and values to `cache`.

    `input_ids` and `positions` are [B, 1]; `mask` [B, L + 1] marks the cached positions to attend
    to (0: left padding) plus the new one; `cache` holds L positions per row.
    """
    body = model.model
    config = model.config
    rows = input_ids.shape[0]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hidden = body.embed_tokens(input_ids)  # [B, 1, H]
    cos, sin = body.rotary_emb(hidden, positions)  # [B, 1, head_dim]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, head_dim]: broadcast over heads
    keep = mask.bool()[:, None, None, :]
    for index, layer in enumerate(body.layers):
        attn = layer.self_attn
        head_dim = attn.head_dim
        group = heads // kv_heads
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(rows, kv_heads, group, head_dim)
        key = attn.k_proj(x).view(rows, kv_heads, 1, head_dim)
        value = attn.v_proj(x).view(rows, kv_heads, 1, head_dim)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        layer_cache: Any = cache.layers[index]
        keys, values = layer_cache.update(key, value)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=keep, scale=attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(rows, 1, heads * head_dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = body.norm(hidden)
    return model.lm_head(hidden[:, -1]).float()
