"""Llama/Qwen2 tensor ops that both our decode step and our training forward compute.

Holds `rotate` (the rotary position embedding, transformers' `apply_rotary_pos_emb` for one
position per leading index). The engine's `engine.torch.decode_step` and the trainer's
`training.packed_forward` each run their own layer loop but must rotate exactly as transformers
does, so the op lives once here, below both. Left out: the layer loops, attention and the fused
projections (each caller's own).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's halves swapped, the new first half negated (transformers' `rotate_half`)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (transformers' `apply_rotary_pos_emb`) of [..., heads, head_dim] with cos/sin
    [..., 1, head_dim]: one token position per leading index, broadcast over the heads."""
    return x * cos + rotate_half(x) * sin
