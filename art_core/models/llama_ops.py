"""Llama/Qwen2 tensor ops that both our decode step and our training forward compute.

Holds `rotate` (the rotary position embedding, transformers' `apply_rotary_pos_emb` for one
position per leading index) and `rotate_signed` (the same with the sign folded into the sine
once, `signed_sin`, and the halves swapped by `swap_halves`: what the decode step runs),
`PLAIN_RMS_NORMS` (the norm classes both fast paths replace by their
own RMSNorm), `layer_types` and `plain_layer_math` (the config rule both fast paths share: which
attention kinds, windows and soft-capping they implement). The engine's `engine.torch.decode_step` and the trainer's
`training.packed_forward` each run their own layer loop but must rotate as transformers does, so
the op lives once here, below both; the trainer differentiates through `training.rotary.rotate`,
the same signed-sine rotation (one multiply-add: to one rounding) as one autograd node with a
closed-form backward. Left out:
the layer loops, attention and the fused projections (each caller's own).
"""

from __future__ import annotations

from typing import Any

import torch

PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
"""transformers' RMSNorm classes whose forward is `weight * (x * rsqrt(mean(x^2) + eps))`, in
float32, the normalised values cast back to the input's dtype before the weight multiplies them."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's halves swapped, the new first half negated (transformers' `rotate_half`)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (transformers' `apply_rotary_pos_emb`) of [..., heads, head_dim] with cos/sin
    [..., 1, head_dim]: one token position per leading index, broadcast over the heads."""
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` [..., head_dim] with its first half negated: the sign `rotate_half` gives x's second
    half, folded into the sine once (per step) instead of into x (per layer)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's two halves exchanged (`rotate_half` without its sign); its own transpose."""
    return x.roll(x.shape[-1] // 2, dims=-1)


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate(x, cos, plain_sin)` given `sin = signed_sin(plain_sin)`: `x * cos + swap_halves(x) *
    sin`, four ops where `rotate` runs seven, rounded as `rotate` rounds (the same values in every
    dtype: negating the sine's half is exact)."""
    return x * cos + swap_halves(x) * sin


SLIDING_WINDOW_FAMILIES = frozenset({"gemma3"})
"""Families whose `layer_types` may mix sliding-window and global layers in the fast paths."""


def layer_types(config: Any) -> list[str]:
    """Each layer's attention kind (`full_attention`, `sliding_attention`, ...); all full when unsaid."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def plain_layer_math(config: Any, family: str) -> bool:
    """Whether a `family` model with `config` runs only the math the fast paths implement: full
    attention (plus sliding-window layers for Gemma 3), no model-wide window (Mistral's applies to
    every layer, and `layer_types` does not say so), no soft-capping, causal attention."""
    allowed = (
        {"full_attention", "sliding_attention"} if family in SLIDING_WINDOW_FAMILIES else {"full_attention"}
    )
    if any(kind not in allowed for kind in layer_types(config)):
        return False
    if family == "mistral" and getattr(config, "sliding_window", None) is not None:
        return False
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return False
    return not getattr(config, "use_bidirectional_attention", False)
