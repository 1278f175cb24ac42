"""The trainer's decoder forward for Llama-family models: a shared prefix and every row's own tokens
in one pass per layer.

A GRPO micro-batch is one prompt and its sampled completions. `training_forward.hidden_states_at`
runs the common prompt once and the rows on top of it, through transformers, as two decoder
calls. On a CPU that makes every weight be read twice per pass (once for a few dozen prefix tokens,
where reading the weight dominates the matmul) and every per-layer op run twice. `packed_hidden_states`
packs the prefix tokens and all rows' own tokens into one [N, hidden] matrix instead, so each
projection, norm and MLP runs once over all of them; only attention looks at the layout:

- the prefix attends causally to itself (one sequence);
- each row attends to the prefix's keys (expanded along the batch, not copied per row before the
  concatenation) and causally to its own real tokens.

Attention is grouped-query attention without repeating keys and values (each kv head's `group`
query heads are stacked along the query axis of one batched matmul) and a plain softmax over
masked scores: no fully masked query row can occur (each row has at least one real token of its
own, see `shared_prefix_length`), so the "safe softmax" bookkeeping of SDPA's math backend is not
needed.

It runs the model's own modules (embedding, norms, projections with their LoRA layers, MLPs,
rotary embedding), so every weight and formula is the model's, and autograd sums the gradients
that reach the prefix from every row. Values and gradients equal transformers' forward to float
rounding (tests/training/test_packed_forward.py). Supported: `LlamaModel`, `Qwen2Model` and `Qwen3Model` (q/k
norms) bodies with full attention in every layer, and `Gemma3TextModel` (q/k norms, norms after
attention and MLP, a rope base and a bias per layer type: sliding-window layers see only keys
less than `sliding_window` positions back) and no attention dropout (`supports_packed_forward`); anything else runs
transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

from art_core.models.llama_ops import layer_types, plain_layer_math
from art_core.training.gated_mlp import activation_of, gated_down
from art_core.training.lora_projections import lora_projections
from art_core.training.lora_update import add_lora_update_
from art_core.training.rms_norm import frozen_plain_norm, rms_norm
from art_core.training.rotary import rotate, signed_sin

SUPPORTED_DECODERS = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "Gemma3TextModel"})
_GEMMA3 = "Gemma3TextModel"
"""Sliding-window layers allowed, a rope base per layer type, norms after attention and MLP."""


def supports_packed_forward(decoder: nn.Module) -> bool:
    """Whether `packed_hidden_states` can run `decoder`: a Llama/Qwen2/Qwen3 body with full attention,
    a Mistral body without a sliding window (Llama's math), or a Gemma 3 text body (sliding-window and global layers, no soft-capping), no attention dropout."""
    name = type(decoder).__name__
    if name not in SUPPORTED_DECODERS:
        return False
    config: Any = getattr(decoder, "config", None)
    if config is None or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    if not plain_layer_math(config, name.removesuffix("TextModel").removesuffix("Model").lower()):
        return False
    return all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))


def packed_hidden_states(
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Tensor,
    prefix: int,
    groups: Tensor | None = None,
) -> Tensor:
    """[N, H] final hidden states at the true entries of `positions` [B, T] (row-major order).

    The first `prefix` tokens must be the same real tokens in every row (0: nothing shared); the
    mask is 1 on real tokens, which come before padding in each row (right padding). `groups` [B]
    (optional) labels rows whose leading tokens past the prefix may be the same (a GRPO group's
    prompt): each label's longest common run of tokens is computed once too (`TokenTree`).
    """
    body: Any = decoder
    tree = TokenTree.of(input_ids, attention_mask, prefix, groups)
    ids, position_ids = tree.pack(input_ids)
    hidden = body.embed_tokens(ids)  # [N, H]: prefix, segments, then each row's own tokens (Gemma: scaled)
    kinds = layer_types(body.config)
    layouts = {kind: _layout(body, hidden, position_ids, tree, kind) for kind in set(kinds)}
    for layer, kind in zip(body.layers, kinds, strict=True):
        out = _attention(layer.self_attn, hidden, layouts[kind], layer.input_layernorm)
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: norms after attention and MLP too
            hidden = hidden + layer.post_attention_layernorm(out)
            hidden = hidden + layer.post_feedforward_layernorm(
                _mlp(layer.mlp, layer.pre_feedforward_layernorm(hidden))
            )
        else:
            hidden = hidden + out
            hidden = hidden + _mlp(layer.mlp, hidden, layer.post_attention_layernorm)
    hidden = rms_norm(body.norm, hidden)
    # index_select, not hidden[index]: positions repeat (every row's first target reads the shared
    # prefix's last token), and advanced indexing's backward adds the repeats with atomic adds in
    # parallel on CPU, in an order that changes from run to run; index_select's backward
    # (`index_add_`) adds them in index order, so a step's gradients are the same bits every run.
    return hidden.index_select(0, tree.index(positions))


@dataclass(frozen=True)
class TokenTree:
    """Where each token of a micro-batch is computed: a prefix common to every row (P tokens), then
    segments (G of them, each padded to S tokens) that the rows of one label share past the prefix,
    then each row's own tokens (padded to R). Packed in that order: N = P + G * S + B * R.

    A row of segment g is [prefix | segment g's real tokens | its own real tokens]; every row keeps
    at least one token of its own. Without labels there are no segments (G = S = 0).
    """

    prefix: int
    """P: leading tokens of every row, computed once."""
    segment_of_row: Tensor
    """[B] long: each row's segment (0 where there are none)."""
    segment_real: Tensor
    """[G, S] bool: the segments' real tokens (a segment shorter than S is padded after them)."""
    own_start: Tensor
    """[B] long: the column (and position) of each row's first own token."""
    own_real: Tensor
    """[B, R] bool: each row's own real tokens (right-padded)."""

    @property
    def rows(self) -> int:
        return int(self.own_real.shape[0])

    @property
    def segments(self) -> int:
        return int(self.segment_real.shape[0])

    @property
    def segment_width(self) -> int:
        return int(self.segment_real.shape[1])

    @property
    def own_width(self) -> int:
        return int(self.own_real.shape[1])

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, prefix: int, groups: Tensor | None) -> TokenTree:
        """The tree of [B, T] right-padded rows sharing `prefix` leading tokens, with the segments of
        `groups` (row labels; None: none): each label's longest common run past the prefix."""
        device = input_ids.device
        lengths = attention_mask.sum(dim=1)
        segment_lengths, segment_of_row = _segments(input_ids, attention_mask, lengths, prefix, groups)
        width = int(segment_lengths.max()) if segment_lengths.numel() else 0
        if width == 0:  # nothing shared past the prefix: no segment level
            segment_lengths = segment_lengths[:0]
            segment_of_row = torch.zeros_like(lengths)
        own_start = prefix + (segment_lengths[segment_of_row] if width else torch.zeros_like(lengths))
        own_lengths = lengths - own_start
        own = int(own_lengths.max())
        return cls(
            prefix=prefix,
            segment_of_row=segment_of_row,
            segment_real=torch.arange(width, device=device)[None] < segment_lengths[:, None],
            own_start=own_start,
            own_real=torch.arange(own, device=device)[None] < own_lengths[:, None],
        )

    def own_columns(self) -> Tensor:
        """[B, R] the column of each row's own token (padding: past the row's end)."""
        return self.own_start[:, None] + torch.arange(self.own_width, device=self.own_start.device)[None]

    def segment_columns(self) -> Tensor:
        """[S] the columns of a segment's tokens."""
        return self.prefix + torch.arange(self.segment_width, device=self.own_start.device)

    def pack(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The packed token ids [N] and their positions [N] (padding: the last column's id)."""
        last = input_ids.shape[1] - 1
        parts = [input_ids[0, : self.prefix]]
        steps = [torch.arange(self.prefix, device=input_ids.device)]
        if self.segments:
            first_row = _first_rows(self.segment_of_row, self.segments)
            columns = self.segment_columns()
            parts.append(input_ids[first_row][:, columns.clamp(max=last)].reshape(-1))
            steps.append(columns.repeat(self.segments))
        columns = self.own_columns()
        parts.append(input_ids.gather(1, columns.clamp(max=last)).reshape(-1))
        steps.append(columns.reshape(-1))
        return torch.cat(parts), torch.cat(steps)

    def index(self, positions: Tensor) -> Tensor:
        """[n] packed index of each true entry of `positions` [B, T] (row-major)."""
        rows, cols = positions.nonzero(as_tuple=True)
        start = self.own_start[rows]
        own = self.prefix + self.segments * self.segment_width + rows * self.own_width + cols - start
        segment = self.prefix + self.segment_of_row[rows] * self.segment_width + cols - self.prefix
        return torch.where(cols < self.prefix, cols, torch.where(cols < start, segment, own))


def _segments(
    input_ids: Tensor, attention_mask: Tensor, lengths: Tensor, prefix: int, groups: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Each label's common run past `prefix` ([G] long, leaving each row one own token; 0 for a
    label of one row) and each row's label index ([B] long)."""
    device = input_ids.device
    if groups is None:
        return torch.zeros(0, dtype=torch.long, device=device), torch.zeros_like(lengths)
    labels, segment_of_row = torch.unique(groups, return_inverse=True)
    same = (input_ids == input_ids[_first_rows(segment_of_row, len(labels))][segment_of_row]) & (
        attention_mask > 0
    )
    lengths_of: list[int] = []
    for label in range(len(labels)):
        members = segment_of_row == label
        if int(members.sum()) < 2:
            lengths_of.append(0)
            continue
        common = int(same[members, prefix:].all(dim=0).long().cumprod(dim=0).sum())
        lengths_of.append(max(0, min(common, int(lengths[members].min()) - 1 - prefix)))
    return torch.tensor(lengths_of, dtype=torch.long, device=device), segment_of_row


def _first_rows(segment_of_row: Tensor, segments: int) -> Tensor:
    """[G] the first row of each segment."""
    rows = torch.arange(len(segment_of_row), device=segment_of_row.device)
    first = torch.full((segments,), len(segment_of_row), dtype=torch.long, device=segment_of_row.device)
    return first.scatter_reduce(0, segment_of_row, rows, reduce="amin")


def _layout(body: Any, hidden: Tensor, position_ids: Tensor, tree: TokenTree, kind: str) -> _Layout:
    """The rotary embedding and attention biases of one layer type (Gemma 3: its rope base, its window)."""
    if type(body).__name__ == _GEMMA3:
        cos, sin = body.rotary_emb(hidden[None], position_ids[None], kind)
    else:
        cos, sin = body.rotary_emb(hidden[None], position_ids[None])
    attn = body.layers[0].self_attn
    window = int(body.config.sliding_window) if kind == "sliding_attention" else None
    return _Layout(
        tree=tree,
        rotary=(cos[0, :, None, :], signed_sin(sin[0, :, None, :])),  # [N, 1, head_dim]
        biases=_biases(tree, attn, hidden.dtype, window),
    )


@dataclass(frozen=True)
class _Layout:
    """What every layer's attention needs to know about the packed tokens."""

    tree: TokenTree
    """Which packed tokens are the prefix, the segments and each row's own."""
    rotary: tuple[Tensor, Tensor]
    """cos and sin [N, 1, head_dim] at each packed token's position, the sine's first half negated
    (`rotary.signed_sin`)."""
    biases: tuple[Tensor | None, Tensor | None, Tensor]
    """Additive attention biases (0 or the dtype's minimum) of the prefix [kv_heads, group * P, P]
    (None without a prefix), of the segments [G * kv_heads, group * S, P + S] (None without
    segments) and of the rows [B * kv_heads, group * R, P + S + R]."""


def _biases(
    tree: TokenTree, attn: Any, dtype: torch.dtype, window: int | None = None
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """The prefix attends causally to itself; a segment to the whole prefix, then causally to its
    real tokens; each row to the prefix, its segment's real tokens, then causally to its own real
    tokens; with a sliding `window`, only to keys less than `window` positions back. Laid out for
    `grouped_attention`'s stacked queries, built once for all layers of a kind."""
    prefix = tree.prefix
    device = tree.own_start.device
    kv_heads, group = _heads(attn)
    blocked = torch.finfo(dtype).min

    def bias(allowed: Tensor) -> Tensor:  # [b, Tq, Tk] -> [b * kv_heads, group * Tq, Tk]
        b, queries, keys = allowed.shape
        values = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, blocked)
        stacked = values[:, None, None].expand(b, kv_heads, group, queries, keys)
        return stacked.reshape(b * kv_heads, group * queries, keys)

    def near(queries: Tensor, keys: Tensor) -> Tensor:  # [..., Tq, Tk]: within the window (all without one)
        gap = queries[..., :, None] - keys[..., None, :]
        return gap < window if window else torch.ones(gap.shape, dtype=torch.bool, device=device)

    prefix_pos = torch.arange(prefix, device=device)
    own_pos = tree.own_columns()  # [B, R]
    own = tree.own_width
    causal = torch.ones(own, own, dtype=torch.bool, device=device).tril()
    parts = [near(own_pos, prefix_pos)]  # [B, R, P]
    segment_bias = None
    if tree.segments:
        segment_pos = tree.segment_columns()  # [S]
        real = tree.segment_real  # [G, S]
        width = tree.segment_width
        seen = torch.ones(width, width, dtype=torch.bool, device=device).tril() & near(
            segment_pos, segment_pos
        )
        # A padding query sees itself too, so that no query of a segment is left with no key.
        mine = (seen[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        to_prefix = near(segment_pos, prefix_pos)[None].expand(tree.segments, width, prefix)
        segment_bias = bias(torch.cat([to_prefix, mine], dim=-1))
        parts.append(near(own_pos, segment_pos) & real[tree.segment_of_row][:, None, :])  # [B, R, S]
    parts.append(causal[None] & near(own_pos, own_pos) & tree.own_real[:, None, :])
    row_bias = bias(torch.cat(parts, dim=-1))
    if not prefix:
        return None, segment_bias, row_bias
    prefix_causal = torch.ones(prefix, prefix, dtype=torch.bool, device=device).tril()
    return bias((prefix_causal & near(prefix_pos, prefix_pos))[None]), segment_bias, row_bias


def _heads(attn: Any) -> tuple[int, int]:
    """(kv_heads, query heads per kv head) of an attention module."""
    config = attn.config
    kv_heads = config.num_key_value_heads
    return kv_heads, config.num_attention_heads // kv_heads


def _attention(attn: Any, x: Tensor, layout: _Layout, norm: nn.Module | None = None) -> Tensor:
    """The attention block's output [N, hidden] for packed inputs [N, hidden] (normed first by `norm`)."""
    tokens, head_dim = x.shape[0], attn.head_dim
    tree = layout.tree
    batch, prefix, segments, width, own = (
        tree.rows,
        tree.prefix,
        tree.segments,
        tree.segment_width,
        tree.own_width,
    )
    query, key, value = (
        out.view(tokens, -1, head_dim) for out in project(x, [attn.q_proj, attn.k_proj, attn.v_proj], norm)
    )
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head before the rotation
        query, key = attn.q_norm(query), attn.k_norm(key)
    query, key = rotate(query, *layout.rotary), rotate(key, *layout.rotary)
    prefix_bias, segment_bias, row_bias = layout.biases
    start = prefix + segments * width

    def blocks(t: Tensor, first: int, count: int, length: int) -> Tensor:  # [count, heads, length, head_dim]
        return t[first : first + count * length].view(count, length, -1, head_dim).transpose(1, 2)

    row_keys, row_values = [blocks(key, start, batch, own)], [blocks(value, start, batch, own)]
    outputs = []
    if prefix_bias is not None:
        prefix_keys = key[:prefix].transpose(0, 1)[None]  # [1, kv_heads, P, head_dim]
        prefix_values = value[:prefix].transpose(0, 1)[None]
        out = grouped_attention(
            query[:prefix].transpose(0, 1)[None], prefix_keys, prefix_values, prefix_bias, attn.scaling
        )
        outputs.append(out[0].transpose(0, 1).reshape(prefix, -1))
        row_keys.insert(0, prefix_keys.expand(batch, -1, -1, -1))
        row_values.insert(0, prefix_values.expand(batch, -1, -1, -1))
    if segment_bias is not None:
        segment_keys, segment_values = (
            blocks(key, prefix, segments, width),
            blocks(value, prefix, segments, width),
        )
        keys, values = segment_keys, segment_values
        if prefix_bias is not None:
            keys = torch.cat([row_keys[0][:1].expand(segments, -1, -1, -1), segment_keys], dim=2)
            values = torch.cat([row_values[0][:1].expand(segments, -1, -1, -1), segment_values], dim=2)
        out = grouped_attention(
            blocks(query, prefix, segments, width), keys, values, segment_bias, attn.scaling
        )
        outputs.append(out.transpose(1, 2).reshape(segments * width, -1))
        row_keys.insert(-1, segment_keys.index_select(0, tree.segment_of_row))
        row_values.insert(-1, segment_values.index_select(0, tree.segment_of_row))
    keys = torch.cat(row_keys, dim=2) if len(row_keys) > 1 else row_keys[0]
    values = torch.cat(row_values, dim=2) if len(row_values) > 1 else row_values[0]
    out = grouped_attention(blocks(query, start, batch, own), keys, values, row_bias, attn.scaling)
    outputs.append(out.transpose(1, 2).reshape(batch * own, -1))
    return attn.o_proj(torch.cat(outputs) if len(outputs) > 1 else outputs[0])


def _mlp(mlp: Any, x: Tensor, norm: nn.Module | None = None) -> Tensor:
    """A gated MLP (Llama's `down(act(gate(x)) * up(x))`) on [N, hidden], normed first by `norm`.
    With a plain LoRA down projection on a frozen base, its second half is `gated_mlp.gated_down`
    (backward keeps `gate` and `up`, not the activation and the product)."""
    gate, up = project(x, [mlp.gate_proj, mlp.up_proj], norm)
    down: Any = mlp.down_proj
    name, activation = active_plain_adapter(down), activation_of(mlp.act_fn)
    if name is not None and activation is not None and _frozen_plain_linear(down.base_layer, x.dtype):
        base = down.base_layer
        return gated_down(
            gate,
            up,
            activation,
            base.weight,
            base.bias,
            down.lora_A[name].weight.to(x.dtype),
            down.lora_B[name].weight.to(x.dtype),
            down.scaling[name],
        )
    return mlp.down_proj(mlp.act_fn(gate) * up)


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Softmax attention [B, heads, Tq, D] for queries [B, heads, Tq, D] and keys/values
    [B, kv_heads, Tk, D], with query head h reading kv head h // (heads / kv_heads) as in
    transformers' `repeat_kv`, without repeating them: each kv head's query heads are stacked along
    the query axis. `bias` [B * kv_heads, group * Tq, Tk] is added to the scaled scores (the
    dtype's minimum where a query must not attend), inside the matmul; every query must attend to
    at least one key. Softmax runs in float32."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    stacked = query.reshape(batch * kv_heads, heads // kv_heads * queries, dim)
    scores = torch.baddbmm(
        bias, stacked, key.reshape(batch * kv_heads, keys, dim).transpose(1, 2), alpha=scale
    )
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.bmm(probs, value.reshape(batch * kv_heads, keys, dim))
    return out.view(batch, heads, queries, dim)


def active_plain_adapter(layer: nn.Module) -> str | None:
    """The adapter through which a peft LoRA `Linear` computes right now, if that is one plain LoRA
    update (no variant such as DoRA, no dropout, no LoRA bias, not merged, not disabled, forward not
    replaced by anyone else); None otherwise."""
    lora: Any = layer
    if type(layer) is not LoraLinear or lora.disable_adapters or lora.merged:
        return None
    active = lora.active_adapters
    if len(active) != 1 or not is_plain_lora(layer, active[0], replaced_by_us=True):
        return None
    return str(active[0])


FUSED_FORWARD = "art_fused_lora"
"""Attribute set on the forwards that `training_forward.fused_lora` installs (the same function)."""


def is_plain_lora(layer: nn.Module, adapter_name: str, *, replaced_by_us: bool = False) -> bool:
    """A plain LoRA Linear for `adapter_name` (no variant such as DoRA, no dropout, no LoRA bias)
    whose forward nobody else has replaced (`replaced_by_us`: or only `fused_lora`)."""
    lora: Any = layer
    if type(layer) is not LoraLinear or adapter_name not in lora.lora_A:
        return False
    replaced = vars(layer).get("forward")
    if replaced is not None and not (replaced_by_us and getattr(replaced, FUSED_FORWARD, False)):
        return False
    dropout = lora.lora_dropout[adapter_name]
    plain_dropout = isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and dropout.p == 0)
    return adapter_name not in lora.lora_variant and plain_dropout and lora.lora_B[adapter_name].bias is None


def project(x: Tensor, linears: list[nn.Module], norm: nn.Module | None = None) -> list[Tensor]:
    """Each linear layer applied to [N, in] inputs `x`, or to `norm(x)` with a `norm`. When all are
    plain LoRA layers of the same active adapter, their down-projections run as one matmul (`x` is
    read once, and backward computes one weight gradient and one input gradient for all of them),
    and each output is `base(x) + scaling * down B^T`, added in place. With plain frozen `nn.Linear`
    bases in `x`'s dtype the whole group is one autograd node (`lora_projections`), the norm inside
    it when it is a plain frozen RMSNorm (backward then keeps `x`, not the normed values); otherwise
    (e.g. `bf16_base`'s copies) the norm runs first, each base layer runs itself and the update is
    `lora_update.add_lora_update_`."""
    names = {active_plain_adapter(linear) for linear in linears}
    name = names.pop() if len(names) == 1 else None
    loras: list[Any] = linears
    bases: list[Any] = [lora.base_layer for lora in loras] if name is not None else []

    def one_node(dtype: torch.dtype) -> bool:
        return name is not None and all(_frozen_plain_linear(base, dtype) for base in bases)

    plain_norm = frozen_plain_norm(norm) if norm is not None and one_node(x.dtype) else None
    if plain_norm is not None and plain_norm[0].dtype != x.dtype:
        plain_norm = None
    if norm is not None and plain_norm is None:  # not inside the projections' node: run it first
        x = rms_norm(norm, x)
    if name is None:
        return [linear(x) for linear in linears]
    stacked_a = torch.cat([lora.lora_A[name].weight for lora in loras]).to(x.dtype)
    if one_node(x.dtype):
        ups = [lora.lora_B[name].weight.to(x.dtype) for lora in loras]
        weights, biases = [base.weight for base in bases], [base.bias for base in bases]
        scalings = [lora.scaling[name] for lora in loras]
        return lora_projections(x, stacked_a, weights, biases, ups, scalings, norm=plain_norm)
    down = F.linear(x, stacked_a)
    outputs, start = [], 0
    for lora in loras:
        rank = lora.lora_A[name].weight.shape[0]
        up = lora.lora_B[name].weight.to(x.dtype)
        # In place on the base output (its matmul's backward does not need it): no copy of it.
        out = add_lora_update_(lora.base_layer(x), down[:, start : start + rank], up, lora.scaling[name])
        outputs.append(out)
        start += rank
    return outputs


def _frozen_plain_linear(module: nn.Module, dtype: torch.dtype) -> bool:
    """An `nn.Linear` itself (no subclass, forward not replaced, e.g. by `bf16_base`) whose weight and
    bias are frozen and in `dtype`: what `lora_projections` computes the base output of."""
    if type(module) is not nn.Linear or "forward" in vars(module):
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    linear: Any = module
    parameters = [p for p in (linear.weight, linear.bias) if p is not None]
    return all(not p.requires_grad and p.dtype == dtype for p in parameters)
