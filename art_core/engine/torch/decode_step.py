"""One decoding step (and a prompt's prefill) of a Llama-family model, without transformers' per-call machinery.

A decode step feeds one new token per row. transformers' forward spends a good part of such a
step on work that does not depend on the data: building 4-D masks, cache bookkeeping, output
objects, keyword plumbing through every layer. On a 2-core CPU that is ~15% of a step of
SmolLM2-135M at 32 rows. `decode_step` runs the same modules (the model's own projections,
norms, MLPs, rotary embedding and head, so every weight and formula is the model's) and does
the attention itself:

- the padding mask is one boolean [B, 1, 1, L] tensor built once per step;
- grouped-query attention without repeating keys and values: each row's queries are viewed as
  [B, kv_heads, group, head_dim], i.e. the `group` query heads that share a kv head act as the
  "query length" of one SDPA call (there is no causal mask to apply for a single new token); in
  float32 on a CPU, two batched matmuls and a softmax instead (`matmul_attention`), 2-3x faster
  than SDPA's kernel on these tiny problems.

`prefill_step` runs the same code for a prompt's tokens (T per row, on top of what the cache
holds), with a causal mask and SDPA, so a prompt multiplies by the same (packed) weights as the
decode steps that follow it.

Supported: `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` (its q/k norms: an
RMSNorm over each head of the queries and keys before the rotation) with full attention in every
layer, and `Gemma3ForCausalLM` (q/k norms, norms after attention and MLP, a rope base per layer
type, sliding-window layers: the last `sliding_window` positions), all with no peft wrapping: the
engine's merged serving copy, or its unmerged one (`lora_serving`), whose projections add a
low-rank update (`LowRank`) to frozen base weights (merged into their packed copies in float32:
`merges_into_pack`). `supports_decode_step` says whether a model
qualifies; anything else runs transformers' forward. The logits equal transformers' to float
rounding (tests/engine/test_decode_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from art_core.engine.torch.packed_layout import write_merged
from art_core.models.hardware import cpu_bf16_pays, onednn_packs_bf16
from art_core.models.llama_ops import PLAIN_RMS_NORMS, layer_types, plain_layer_math, signed_sin
from art_core.models.llama_ops import rotate_signed as rotate

SUPPORTED_MODELS = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"}
)
_PER_LAYER_TYPE_ROTARY = frozenset({"Gemma3ForCausalLM"})
"""Models whose rotary embedding takes the layer type (a rope base per attention kind)."""


def supports_decode_step(model: Any) -> bool:
    """Whether `decode_step` can run `model`: a plain Llama/Qwen2/Qwen3 causal LM with full attention,
    a Mistral without a sliding window (then Llama's math), or a Gemma 3 text model (sliding-window
    and global layers) without logit soft-capping."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        return False
    if not plain_layer_math(model.config, name.removesuffix("ForCausalLM").lower()):
        return False
    body = getattr(model, "model", None)
    return body is not None and hasattr(body, "rotary_emb") and hasattr(body, "layers")


def fuse_projections(model: Any) -> None:
    """Store each layer's q/k/v and gate/up weights (and biases) in one buffer, as views of it.

    The modules keep working as before (their weights are now slices of the shared buffer), and
    `decode_step` runs one matmul where it ran three (q, k, v) or two (gate, up): measured ~40%
    and ~10% faster for SmolLM2's shapes at 32 rows. Call it on a model nothing else holds
    references to its weights yet (the serving copy, before its merge map is built), since the
    old weight tensors are replaced.
    """
    if not supports_decode_step(model):
        return
    vars(model).pop(LAYERS, None)  # `decode_step`'s view of the layers, made before the fusion
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        setattr(attn, QKV, _fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
        setattr(mlp, GATE_UP, _fuse([mlp.gate_proj, mlp.up_proj]))


def _fuse(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight buffer (and one bias buffer if they have biases) whose row slices become the weights."""
    weights = [linear.weight for linear in linears]
    fused = torch.cat([w.detach() for w in weights])
    has_bias = all(linear.bias is not None for linear in linears)
    bias = torch.cat([linear.bias.detach() for linear in linears]) if has_bias else None
    start = 0
    for linear, weight in zip(linears, weights, strict=True):
        rows = weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return fused, bias


class LowRank:
    """`out += (x @ down^T) @ up^T`: one LoRA adapter's update of a projection (or of a fused group
    of them: `down` stacks their A matrices, `up` holds each one's scaled B on the block diagonal),
    the scale folded into `up`; both kept transposed ([in, rank], [rank, out]) so the update is one
    small matmul and one in-place `addmm_` (measured ~25% faster than two `F.linear` and an add for
    SmolLM2's q/k/v at 32 rows). `lora_serving.UnmergedWeights` replaces the two tensors whenever
    the adapter's weights change; every reader holds this object, so it sees the new ones."""

    __slots__ = ("down_t", "up_t")

    def __init__(self, down_t: torch.Tensor, up_t: torch.Tensor) -> None:
        self.down_t = down_t
        """[in, rank]"""
        self.up_t = up_t
        """[rank, out]"""

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` (contiguous, [..., out]) plus the update of `x` ([..., in]), in place."""
        out.view(-1, out.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]).mm(self.down_t), self.up_t)
        return out


Weight = torch.Tensor | tuple[torch.Tensor, ...]
"""A projection's weight, or (in the unmerged serving copy) the weights of a fused group of
projections, which `_linear` multiplies by as one packed matrix."""


@dataclass(frozen=True)
class _RMSNorm:
    """A plain RMSNorm (`PLAIN_RMS_NORMS`) as torch's one `rms_norm` op: its weight and epsilon."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class _Layer:
    """What `decode_step` reads of one decoder layer, looked up once per model (`_layers`): attribute
    chains through `nn.Module.__getattr__` (and `hasattr` probes that raise inside it) cost ~2-4 us
    each, ~20 of them a layer, every step."""

    kind: str
    """The layer's attention kind (`layer_types`): picks its rotary table."""
    window: int | None
    """Sliding-window length for a sliding-attention layer, else None."""
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    input_norm: Any
    """`_RMSNorm`, or the module where the norm is not a plain RMSNorm (`_norm` runs either)."""
    post_attention_norm: Any
    pre_feedforward_norm: Any | None
    """Gemma 3's norms around the MLP (it also normalises the attention's output); None elsewhere."""
    post_feedforward_norm: Any | None
    q_norm: Any | None
    """Qwen3's and Gemma 3's per-head norms of queries and keys before the rotation; None elsewhere."""
    k_norm: Any | None
    attn: Any
    """The attention module (its q/k/v projections when they are not fused)."""
    qkv: tuple[Weight, torch.Tensor | None] | None
    """`fuse_projections`' q/k/v weight and bias (the unmerged copy's: the three weights), or None."""
    qkv_lora: LowRank | None
    """The unmerged copy's LoRA update of q/k/v together, or None."""
    o_proj: Any
    o_lora: LowRank | None
    mlp: Any
    gate_up: tuple[Weight, torch.Tensor | None] | None
    """`fuse_projections`' gate/up weight and bias, or None (the MLP module runs whole)."""
    gate_up_lora: LowRank | None
    down_proj: Any
    down_lora: LowRank | None
    act: Any


LAYERS = "art_decode_layers"
"""Attribute of a model holding its `_Layer`s (made on the first `decode_step`)."""

QKV, GATE_UP, LOW_RANK = "art_qkv", "art_gate_up", "art_low_rank"
"""Attributes `decode_step` reads where present: a fused q/k/v (on the attention module) or
gate/up (on the MLP) weight and bias; a `LowRank` on a projection, or with the `_lora` suffix on
the attention module or MLP for its fused group."""


def _layers(model: Any) -> tuple[_Layer, ...]:
    """`model`'s layers as `decode_step` reads them, made once and kept on the model. The serving copy's
    weights change in place (re-merges); its modules and parameters are never replaced after
    `fuse_projections`, which runs before the first step."""
    cached: tuple[_Layer, ...] | None = getattr(model, LAYERS, None)
    if cached is not None:
        return cached
    config, kinds = model.config, layer_types(model.config)
    layers = []
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        sliding = kinds[index] == "sliding_attention"
        layers.append(
            _Layer(
                kind=kinds[index],
                window=getattr(attn, "sliding_window", None) if sliding else None,
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=attn.head_dim,
                scaling=attn.scaling,
                input_norm=_norm_of(layer.input_layernorm),
                post_attention_norm=_norm_of(layer.post_attention_layernorm),
                pre_feedforward_norm=_norm_of(layer.pre_feedforward_layernorm) if gemma else None,
                post_feedforward_norm=_norm_of(layer.post_feedforward_layernorm) if gemma else None,
                q_norm=_norm_of(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None,
                k_norm=_norm_of(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None,
                attn=attn,
                qkv=getattr(attn, QKV, None),
                qkv_lora=getattr(attn, QKV + "_lora", None),
                o_proj=attn.o_proj,
                o_lora=getattr(attn.o_proj, LOW_RANK, None),
                mlp=mlp,
                gate_up=getattr(mlp, GATE_UP, None),
                gate_up_lora=getattr(mlp, GATE_UP + "_lora", None),
                down_proj=mlp.down_proj,
                down_lora=getattr(mlp.down_proj, LOW_RANK, None),
                act=mlp.act_fn,
            )
        )
    result = tuple(layers)
    setattr(model, LAYERS, result)
    return result


def _norm_of(norm: Any) -> Any:
    """`_RMSNorm` for a plain RMSNorm module, else the module itself."""
    if type(norm).__name__ in PLAIN_RMS_NORMS:
        return _RMSNorm(norm.weight, norm.variance_epsilon)
    return norm


def decode_step(
    model: Any, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
) -> torch.Tensor:
    """Logits [B, V] (float32) of one new token per row, appending its keys and values to `cache`.

    `input_ids` and `positions` are [B, 1]; `mask` [B, L + 1] marks the cached positions to attend
    to (0: left padding) plus the new one; `cache` holds L positions per row.
    """
    hidden = _decoder(model, input_ids, positions, mask, cache)
    return _head(model, hidden)


def supports_prefill_step(model: Any) -> bool:
    """Whether `prefill_step` can run `model`: what `decode_step` runs, without sliding-window layers
    (a prompt's tokens would each need their own window)."""
    return supports_decode_step(model) and all(kind == "full_attention" for kind in layer_types(model.config))


def prefill_step(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: DynamicCache,
    logits: bool = True,
) -> torch.Tensor | None:
    """`decode_step` for T new tokens per row (a prompt, left-padded, or its part past a cached
    prefix): the logits [B, V] (float32) of each row's last token, or None with `logits=False` (a
    shared prefix whose logits nobody reads: the head is the largest matmul of a short forward).

    `input_ids` and `positions` are [B, T]; `mask` [B, L + T] marks the cached positions and new
    tokens to attend to (0: padding); `cache` holds L positions per row (`supports_prefill_step`).
    Each new token attends to the cached positions and to the new ones up to itself, as
    transformers' causal mask has it; a padding token also attends to itself, so its (never read)
    keys and values stay finite.

    Why not transformers' forward: the same weights as the decode steps then serve the prompt, where
    they are packed (`pack_weights`: oneDNN's blocked layout, and in float32 the unmerged copy's
    LoRA update merged in), which a prompt's few dozen rows multiply by 1.4-1.8x faster than by
    the plain weights (SmolLM2's shapes, 24 rows, 2 AVX2 cores) and without the update's two
    small matmuls a projection; and none of the forward's per-call machinery.
    """
    hidden = _decoder(model, input_ids, positions, mask, cache, causal=input_ids.shape[1] > 1)
    return _head(model, hidden) if logits else None


def _head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The logits [B, V] (float32) of the last position of `hidden` [B, T, H]: final norm, head."""
    packs: dict[int, _Packed] | None = getattr(model, PACKED_WEIGHTS, None)
    head_packs: dict[int, _Packed] | None = packs if packs is not None else getattr(model, PACKED_HEAD, None)
    last = _norm(_norm_of(model.model.norm), hidden[:, -1])
    head = model.lm_head
    return _apply(head, last, head_packs, getattr(head, LOW_RANK, None)).float()


def _decoder(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: DynamicCache,
    causal: bool = False,
) -> torch.Tensor:
    """The decoder layers' output [B, T, H] for `input_ids` [B, T] (T = 1 unless `causal`),
    appending their keys and values to `cache`; `mask` [B, L + T] as `prefill_step` says."""
    body = model.model
    layers = _layers(model)
    packs: dict[int, _Packed] | None = getattr(model, PACKED_WEIGHTS, None)
    rows, width = input_ids.shape
    hidden = body.embed_tokens(input_ids)  # [B, T, H] (Gemma 3's module scales by sqrt(H) itself)
    kinds = {layer.kind for layer in layers}
    if type(model).__name__ in _PER_LAYER_TYPE_ROTARY:  # Gemma 3: local and global rope bases
        tables = {kind: body.rotary_emb(hidden, positions, kind) for kind in kinds}
    else:
        tables = dict.fromkeys(kinds, body.rotary_emb(hidden, positions))  # [B, T, head_dim] each
    # [B, T, 1, head_dim]: one table for all heads of a position
    rotary = {kind: (cos[:, :, None], signed_sin(sin)[:, :, None]) for kind, (cos, sin) in tables.items()}
    if causal:
        masking = _causal_mask(mask, width)
        bias = None
    else:
        keep = mask.bool()[:, None, None, :]
        bias = _attention_bias(keep, hidden, model.config.num_key_value_heads)
        # SDPA's boolean mask, or matmul_attention's additive one as its [B * kv_heads, 1, L + 1] problems
        masking = keep if bias is None else bias.view(-1, 1, keep.shape[-1])
    total = mask.shape[-1]
    for index, layer in enumerate(layers):
        query, key, value = _qkv(layer, _norm(layer.input_norm, hidden), *rotary[layer.kind], packs, causal)
        layer_cache: Any = cache.layers[index]
        keys, values = layer_cache.update(key, value)
        length = keys.shape[-2]  # a sliding-window cache layer returns its last positions only
        attend = masking if length == total else masking[..., -length:]
        if layer.window:  # rows are contiguous in the padded layout: the window is the last `window` columns
            window = layer.window
            keys, values, attend = keys[..., -window:, :], values[..., -window:, :], attend[..., -window:]
        if causal:  # [B, heads, T, D] queries against the kv heads they share
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=attend, scale=layer.scaling, enable_gqa=True
            ).transpose(1, 2)
        elif bias is None:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=attend, scale=layer.scaling)
        else:
            out = matmul_attention(query, keys, values, attend, layer.scaling)
        out = _apply(layer.o_proj, out.reshape(rows, width, -1), packs, layer.o_lora)
        if layer.pre_feedforward_norm is not None:  # Gemma 3: norms after attention and MLP too
            hidden = hidden + _norm(layer.post_attention_norm, out)
            mlp = _mlp(layer, _norm(layer.pre_feedforward_norm, hidden), packs)
            hidden = hidden + _norm(layer.post_feedforward_norm, mlp)
        else:
            hidden = hidden + out
            hidden = hidden + _mlp(layer, _norm(layer.post_attention_norm, hidden), packs)
    return hidden


def _causal_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """SDPA's boolean mask [B, 1, T, L + T] for `width` (T) new tokens per row after L cached
    positions: each new token attends to the unmasked cached positions and new tokens up to
    itself, and always to itself (a padding token's row is then never empty: no NaN)."""
    total = mask.shape[-1]
    columns = torch.arange(total, device=mask.device)
    own = (total - width) + torch.arange(width, device=mask.device)[:, None]  # each new token's column
    return (mask.bool()[:, None, None, :] & (columns <= own)) | (columns == own)


def _attention_bias(keep: torch.Tensor, hidden: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
    """The additive mask [B, kv_heads, 1, L + 1] (0 where `keep`, -inf elsewhere) for
    `matmul_attention` when the step runs in float32 on a CPU; None where it runs SDPA. Built once a
    step, per kv head, so each layer's slice of it is a view `matmul_attention` uses as it is.

    Why by dtype: a decode step's attention is B x kv_heads tiny problems ([group, D] x [D, L]),
    and SDPA's CPU flash kernel spends more on their setup than on their FLOPs. Two batched
    matmuls and a softmax in float32 took 159 against SDPA's 468 us a layer (SmolLM2, 32 rows,
    context 51, 2 threads, AVX2; 150 against 341 on AVX-512), equally exact. In bf16 the scores
    need float32 to stay as exact as SDPA's, and with the casts that was no faster in the engine
    (docs/benchmarks.md, "Serving throughput"); on GPUs SDPA's kernels are the fast path.
    """
    if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
        return None
    rows, _, _, width = keep.shape
    bias = torch.zeros((rows, kv_heads, 1, width), dtype=hidden.dtype)
    return bias.masked_fill_(~keep, float("-inf"))


def matmul_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention [B, kv_heads, group, D] of one new token per row: queries [B, kv_heads,
    group, D] (each kv head's query heads along the query axis), keys and values [B, kv_heads, L, D],
    `bias` [B, kv_heads or 1, 1, L] (or already as the problems' [B * kv_heads, 1, L]: what
    `decode_step` passes) added to the scaled scores (-inf: not attended; every row attends to at
    least its new token). The same values as `F.scaled_dot_product_attention` with the mask.

    Three ops on the (row, kv head) problems as one batch: `baddbmm` (scores, scale and mask in
    one), softmax, `bmm`; on a cache's views of keys and values the batch axes merge without a
    copy. Against `matmul` + `mul_` + `add_` on the 4-d tensors: 167 against 276 us a layer at
    context 60, 257 against 419 at 100 (SmolLM2's shapes, 32 rows, 2 threads, AVX2).
    """
    rows, kv_heads, group, dim = query.shape
    length = keys.shape[-2]
    problems = rows * kv_heads
    if bias.dim() == 4:
        bias = bias.expand(rows, kv_heads, 1, length).reshape(problems, 1, length)
    scores = torch.baddbmm(
        bias,
        query.reshape(problems, group, dim),
        keys.reshape(problems, length, dim).transpose(1, 2),
        alpha=scale,
    )
    out = torch.bmm(scores.softmax(dim=-1), values.reshape(problems, length, dim))
    return out.view(rows, kv_heads, group, dim)


def _qkv(
    layer: _Layer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    packs: dict[int, _Packed] | None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries, rotated keys and values [B, kv_heads, T, D] of the tokens `x` [B, T, H]; with
    q/k norms (Qwen3, Gemma 3) over each head before the rotation. `cos` and `sin` are [B, T, 1, D],
    `sin` `signed_sin` of the model's sine (`rotate_signed`). The queries are [B, heads, T, D] where
    `causal` (a prompt's tokens), else (T = 1) [B, kv_heads, group, D]: the query heads that share
    a kv head as one attention problem's rows."""
    rows, width = x.shape[0], x.shape[1]
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    if layer.qkv is not None:
        qkv = _linear(x, *layer.qkv, packs, layer.qkv_lora).view(rows, width, heads + 2 * kv_heads, head_dim)
    else:
        attn = layer.attn
        qkv = torch.cat(
            [
                attn.q_proj(x).view(rows, width, heads, head_dim),
                attn.k_proj(x).view(rows, width, kv_heads, head_dim),
                attn.v_proj(x).view(rows, width, kv_heads, head_dim),
            ],
            dim=2,
        )
    value = qkv[:, :, heads + kv_heads :].transpose(1, 2)
    if layer.q_norm is None:  # queries and keys rotated together: one set of elementwise ops instead of two
        rotated = rotate(qkv[:, :, : heads + kv_heads], cos, sin)
        query, key = rotated[:, :, :heads], rotated[:, :, heads:]
    else:
        query = rotate(_norm(layer.q_norm, qkv[:, :, :heads]), cos, sin)
        key = rotate(_norm(layer.k_norm, qkv[:, :, heads : heads + kv_heads]), cos, sin)
    if causal:
        return query.transpose(1, 2), key.transpose(1, 2), value
    group = heads // kv_heads
    return query.reshape(rows, kv_heads, group, head_dim), key.transpose(1, 2), value


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A layer's norm (`_norm_of`): a plain RMSNorm as torch's one `rms_norm` op (the module runs ~8
    elementwise ops; the values are the same: both normalise in float32), any other its module."""
    if type(norm) is not _RMSNorm:
        return norm(x)  # type: ignore[no-any-return]
    return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _mlp(layer: _Layer, x: torch.Tensor, packs: dict[int, _Packed] | None) -> torch.Tensor:
    """The layer's MLP, with gate and up in one matmul when `fuse_projections` fused them."""
    if layer.gate_up is None:
        return layer.mlp(x)  # type: ignore[no-any-return]
    gate, up = _linear(x, *layer.gate_up, packs, layer.gate_up_lora).chunk(2, dim=-1)
    return _apply(layer.down_proj, layer.act(gate) * up, packs, layer.down_lora)


PACKED_WEIGHTS = "art_packed_weights"
"""Attribute of a model whose decode-step matmuls use oneDNN-packed weights (`pack_weights`)."""

PACKED_HEAD = "art_packed_head"
"""Attribute of a model whose decode step multiplies by a oneDNN-packed copy of its output head
only (`pack_weights(model, "head")`)."""

PACK_ROWS_HINT = 32
"""The row count oneDNN lays a packed weight out for, whatever the row count of the step that packs
it. A packed copy serves every later step of its weight version, whose batches range from 1 row to
the engine's maximum, and used to be laid out for the first caller's rows: often 1 (a lone request,
the first step after a re-merge). Measured on an AVX2 CPU in float32 (SmolLM2's shapes, 2 threads,
docs/benchmarks.md "The packed layout's row hint"): a layout packed for 1 row is 10-40% slower at
every batch from 1 to 128 rows (32 rows x 576 -> 3072: 1,144 against 928 us; the head: 17.1
against 14.9 ms), and hints from 8 to 256 are alike."""


_UpdateStamp = tuple[torch.Tensor, torch.Tensor, int, int]
"""A `LowRank`'s `down_t` and `up_t` (held, so their identities stay theirs) and their versions."""


@dataclass(frozen=True)
class _Packed:
    weight: Weight
    """The plain weight (or fused group) the packed copy was made from (kept to compare identities)."""
    version: int | tuple[int, ...]
    """`_version(weight)` when packed: every in-place write (a re-merge) bumps it."""
    packed: torch.Tensor
    """oneDNN's blocked layout of `weight` (a group's weights stacked, in order), plus `merged`'s
    product where that is not None."""
    merged: LowRank | None = None
    """The `LowRank` update merged into `packed` (`merges_into_pack`); None: the plain weight's alone."""
    update: _UpdateStamp | None = None
    """`merged`'s tensors and their version counters when merged (`refresh_packs` and every decode
    step merge again when they differ)."""


def merges_into_pack(weight: Weight, lora: LowRank | None) -> bool:
    """Whether a packed decode step multiplies by `weight + lora` merged into one packed matrix
    rather than by the packed `weight` plus `lora.add_to` (the unmerged serving copy's update).

    In float32: a merge rounds the sum to float32's 24 bits, below the update's own size by far,
    and spares each decode step two small matmuls a projection (240 ops a step for SmolLM2-135M:
    ~11 ms of a 118 ms step at 32 rows on an AVX2-only AMD EPYC, docs/benchmarks.md). The merge
    is redone (~0.15 s for SmolLM2-135M on 2 AVX2 cores) only when the update changed: once a train
    step. Not in bf16, whose 8-bit mantissa would round most of a LoRA update away."""
    if lora is None:
        return False
    first = weight if isinstance(weight, torch.Tensor) else weight[0]
    return first.dtype == torch.float32


def _update_stamp(lora: LowRank) -> _UpdateStamp:
    return (lora.down_t, lora.up_t, lora.down_t._version, lora.up_t._version)


def _same_update(stamp: _UpdateStamp | None, lora: LowRank | None) -> bool:
    if stamp is None or lora is None:
        return stamp is None and lora is None
    down_t, up_t, down_version, up_version = stamp
    return (
        down_t is lora.down_t
        and up_t is lora.up_t
        and down_version == lora.down_t._version
        and up_version == lora.up_t._version
    )


def pack_weights(model: Any, pack: bool | Literal["head"] | None = None) -> bool:
    """Let `decode_step` multiply by oneDNN-packed copies of `model`'s weights (on a CPU).

    oneDNN reorders a plain weight into its blocked layout inside every matmul; for a decode step's
    few rows that reorder is a good part of the matmul (SmolLM2, 32 rows x 576 -> 3072 in bf16:
    ~230 us packed against ~310 us plain, weights not in cache). Packed copies are made on first
    use and remade when the weight was written since (its version counter: the serving copy's
    re-merges write in place), so they never serve stale weights. They cost one more copy of the
    matmul weights in memory. Returns whether packing is on: `pack` None (auto) packs bf16 weights
    where oneDNN can (`hardware.onednn_packs_bf16`) and float32 weights where bf16 does not pay
    (`hardware.cpu_bf16_pays`: no native bf16, or bf16 measured slower; SmolLM2, 32 rows x 576 ->
    3072 in float32 on an AVX2-only CPU: ~860 us packed against ~1560 us plain, the 49152-row head
    17 ms against 45 ms); True packs either dtype oneDNN packs; False never. "head": only the
    output head, in either dtype oneDNN packs: the largest matmul of a step, and one that LoRA
    training never changes (no re-merge repacks it), for one more copy of the head alone
    (SmolLM2-135M: 113 MB in float32).
    """
    parameter = next(model.parameters())
    usable = packable(parameter.dtype, parameter.device, pack)
    if usable:
        setattr(model, PACKED_HEAD if pack == "head" else PACKED_WEIGHTS, {})
    return usable


def packable(dtype: torch.dtype, device: torch.device, pack: bool | Literal["head"] | None) -> bool:
    """Whether `pack_weights(model, pack)` packs a model of `dtype` on `device`."""
    if pack is False or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return onednn_packs_bf16()
    return dtype == torch.float32 and (pack in (True, "head") or not cpu_bf16_pays())


def _apply(
    linear: Any, x: torch.Tensor, packs: dict[int, _Packed] | None, lora: LowRank | None = None
) -> torch.Tensor:
    """A linear module on `x`: through its packed weight (plus its `LowRank` update `lora`) when
    `packs` holds them, else the module itself (its hooks and its own update included)."""
    if packs is None:
        return linear(x)  # type: ignore[no-any-return]
    return _linear(x, linear.weight, linear.bias, packs, lora)


def _linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    packs: dict[int, _Packed] | None,
    lora: LowRank | None = None,
) -> torch.Tensor:
    """`F.linear` (plus the `LowRank` update `lora`), through a packed copy of `weight` when `packs`
    holds them: in float32 one with `lora` merged into it (`merges_into_pack`), else `lora` added to
    its product. A fused group (a tuple of weights) is multiplied by as their stacked rows."""
    if packs is None:
        out = F.linear(x, weight if isinstance(weight, torch.Tensor) else torch.cat(weight), bias)
        return out if lora is None else lora.add_to(out, x)
    merged = lora if merges_into_pack(weight, lora) else None
    entry = _packed(weight, packs, merged)
    out = torch.ops.mkldnn._linear_pointwise.default(x, entry.packed, bias, "none", [], "")
    return out if lora is None or merged is not None else lora.add_to(out, x)


def _packed(weight: Weight, packs: dict[int, _Packed], merged: LowRank | None) -> _Packed:
    """`packs`' entry for `weight` (with `merged`'s update in it where not None), made or made again
    when the weight or the update changed since: a write bumped a version counter, or the update's
    tensors were replaced (`lora_serving.UnmergedWeights.sync`)."""
    version = _version(weight)
    entry = packs.get(id(weight))
    if (
        entry is not None
        and entry.weight is weight
        and entry.version == version
        and _same_update(entry.update, merged)
    ):
        return entry
    # In inference mode whether or not the caller is (decode steps are, `sync` is not): a pack made
    # in a decode step is an inference tensor, which only inference mode may write in place.
    with torch.inference_mode():
        if entry is not None and entry.weight is weight and _write_in_place(entry.packed, weight, merged):
            stamp = None if merged is None else _update_stamp(merged)
            entry = packs[id(weight)] = _Packed(weight, version, entry.packed, merged, stamp)
            return entry
        plain = _plain(weight, merged)
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_ROWS_HINT)
        del plain  # only the packed layout is kept
        if entry is not None and entry.weight is weight and _same_layout(entry.packed, packed):
            # Into the old buffer: a train step's merges then leave the heap's layout as it was
            # (new buffers while the old ones lived had `art demo` peak ~80 MB higher).
            packed = entry.packed.copy_(packed)
    stamp = None if merged is None else _update_stamp(merged)
    entry = packs[id(weight)] = _Packed(weight, version, packed, merged, stamp)
    return entry


def _write_in_place(packed: torch.Tensor, weight: Weight, merged: LowRank | None) -> bool:
    """Write `weight` plus `merged`'s product into `packed`, its old packed copy, without oneDNN's
    reorder where the packed layout is a known blocking (`packed_layout.write_merged`: ~2.5x
    faster than `_plain`, the reorder and the copy back, on an AVX2 CPU); False where not."""
    up_t, down_t = (None, None) if merged is None else (merged.up_t, merged.down_t)
    return write_merged(packed, _members(weight), up_t, down_t, PACK_ROWS_HINT)


def _members(weight: Weight) -> tuple[torch.Tensor, ...]:
    """The matrices a `Weight` stands for: itself, or a group's, in order."""
    return (weight,) if isinstance(weight, torch.Tensor) else weight


def _plain(weight: Weight, merged: LowRank | None) -> torch.Tensor:
    """The plain matrix `_packed` packs: `weight` (a group's weights stacked, in order) plus
    `merged`'s product where not None. Never writes `weight` (the trainer's base weights): the sum
    goes to a new matrix, each member's rows in one pass (`addmm` into their slice: a train step's
    re-merge ~7% shorter than stacking first and adding after)."""
    weights = _members(weight)
    if merged is None:
        return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
    down = merged.down_t.t()
    plain = weights[0].new_empty(sum(w.shape[0] for w in weights), weights[0].shape[1])
    start = 0
    for w in weights:
        end = start + w.shape[0]
        torch.addmm(w.detach(), merged.up_t[:, start:end].t(), down, out=plain[start:end])
        start = end
    return plain


def refresh_packs(model: Any) -> int:
    """Merge again, now, every packed decode weight of `model` whose merged update
    (`merges_into_pack`) changed: what its next decode step would otherwise do. Returns how many
    were merged again; a model without packs, or with none made yet (the first decode step makes
    them), 0."""
    packs: dict[int, _Packed] | None = getattr(model, PACKED_WEIGHTS, None)
    if not packs:
        return 0
    before = list(packs.values())
    for entry in before:
        if entry.merged is not None:
            _packed(entry.weight, packs, entry.merged)
    return sum(1 for entry in before if packs[id(entry.weight)] is not entry)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _version(weight: Weight) -> int | tuple[int, ...]:
    """The torch version counter(s) of `weight`: they change with every in-place write."""
    if isinstance(weight, torch.Tensor):
        return weight._version
    return tuple(w._version for w in weight)
