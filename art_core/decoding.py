"""Decoding one padded batch: the per-row state and the prefill + token-by-token loop.

`DecodeBatch` left-pads the prompts of its rows, prefills them into a transformers
`DynamicCache` and decodes one token per step for every row until all rows have finished,
under whatever grad/eval mode the caller set (the engine uses `torch.inference_mode` and eval
mode). With a peft model it passes `adapter_names` (one per row, "__base__" for the base model)
to every forward, so rows with different LoRA adapters share the batch. Rows with the same
prompt and adapter (the n completions of a request, a GRPO group) are prefilled once and their
cache rows copied. The cache's full-attention layers write each step's keys and values into
reserved room (`GrowingLayer`) instead of concatenating the whole cache anew every step (28% of
a decode step's time with 400-token prompts, SmolLM2 bf16, B=32).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from art_core.grammar import RowConstraint
from art_core.sampling import SamplingParams, find_stop, sample_next, stop_window_tokens

BASE_ADAPTER = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """Sampled ids, including the final eos/stop token if one was sampled."""
    logprobs: list[float]
    """Raw log-softmax (temperature 1, before top-p) of each sampled id under the serving policy:
    what the trainer's importance correction compares against (fp32: equal to ~1e-5)."""
    top_logprobs: list[list[tuple[int, float]]]
    """Per sampled position, the `params.top_logprobs` most likely (id, logprob) pairs (empty lists if 0)."""
    text: str
    """Decoded completion, without the final eos/stop token and without the stop string (if hit)."""
    finish_reason: str
    """"stop" (eos, a stop id or a stop string), "length" (max_tokens or the context window) or
    "abort" (its request was cancelled mid-decoding; nobody receives it)."""


@dataclass(eq=False)
class RowState:
    """One completion being decoded: its request, its sampler and what it sampled so far."""

    job: Any
    """The engine's request record (opaque here)."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    max_new: int
    generator: torch.Generator
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    constraint: RowConstraint | None = None
    """The row's grammar state when its request is constrained (JSON schema, forced tool call)."""
    on_token: Callable[[RowState], bool] | None = None
    """Called after each recorded token (finish_reason already decided), on the decoding thread:
    streams it; returning False ends the row with finish_reason "abort" (its request was cancelled)."""

    def push(self, token: int, logprob: float, top: list[tuple[int, float]], tokenizer: Any) -> None:
        """Record a sampled token and decide whether the row is finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.top.append(top)
        if self.constraint is not None and token not in self.stop_ids:
            self.constraint.consume(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.params.stop and self._tail_has_stop(tokenizer):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new:
            self.finish_reason = "length"
        if self.on_token is not None and not self.on_token(self) and self.finish_reason is None:
            self.finish_reason = "abort"

    def _tail_has_stop(self, tokenizer: Any) -> bool:
        tail = self.token_ids[-stop_window_tokens(self.params.stop) :]
        return find_stop(_decode(tokenizer, tail), self.params.stop) is not None

    def completion(self, tokenizer: Any) -> Completion:
        ids = self.token_ids
        if self.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = _decode(tokenizer, ids)
        cut = find_stop(text, self.params.stop)
        return Completion(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top),
            text=text if cut is None else text[:cut],
            finish_reason=self.finish_reason or "length",
        )


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that keeps its keys and values in a buffer with room to grow.

    `keys`/`values` are views of the first `seq_len` positions of the buffers; `update` writes
    the new positions in place and reallocates (copying once) only when the room runs out,
    growing by up to `room` positions (at least 64, at most the current length).
    """

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = max(1, room)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._owns_views(key_states) or length + new > self._keys.shape[-2]:  # type: ignore[union-attr]
            self._reserve(length + new + min(self.room, max(64, length + new)), key_states, value_states)
        assert self._keys is not None and self._values is not None
        self._keys[..., length : length + new, :] = key_states
        self._values[..., length : length + new, :] = value_states
        self.keys, self.values = self._keys[..., : length + new, :], self._values[..., : length + new, :]
        return self.keys, self.values

    def _owns_views(self, key_states: torch.Tensor) -> bool:
        """Whether `keys` is still a view of our buffer (crop, select and repeat may have replaced it)."""
        buffer, keys = self._keys, self.keys
        if buffer is None or buffer.shape[0] != key_states.shape[0]:
            return False
        return self.get_seq_length() == 0 or (keys is not None and keys.data_ptr() == buffer.data_ptr())

    def _reserve(self, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        length = self.get_seq_length()
        batch, heads, _, _ = key_states.shape
        keys = key_states.new_empty((batch, heads, capacity, key_states.shape[-1]))
        values = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
        if length and self.keys is not None and self.values is not None:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._keys, self._values = keys, values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (repeats allowed), room included."""
        length = self.get_seq_length()
        if self._keys is None or self._values is None or length == 0:
            super().batch_select_indices(indices)
            return
        self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]


def growing_cache(config: Any, room: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers are `GrowingLayer`s with `room`."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_kwarg(model: Any) -> str:
    """The forward argument that takes the KV cache: `cache` (transformers >= 5.24) or `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class DecodeBatch:
    """One left-padded batch: prefill, then token-by-token decoding with a DynamicCache."""

    def __init__(self, model: Any, tokenizer: Any, rows: list[RowState], use_adapter_names: bool) -> None:
        self.model, self.tokenizer, self.rows = model, tokenizer, list(rows)
        self.use_adapter_names = use_adapter_names
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(len(r.prompt_ids) for r in rows)
        self.input_ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
        self.mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            self.input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids, dtype=torch.long)
            self.mask[i, width - len(row.prompt_ids) :] = 1
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.device = next(model.parameters()).device
        self.input_ids, self.mask, self.positions = (
            t.to(self.device) for t in (self.input_ids, self.mask, self.positions)
        )
        self.temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        self.top_ps = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        self.adapter_names = [r.adapter or BASE_ADAPTER for r in rows]
        self.cache = growing_cache(model.config, room=max(r.max_new for r in rows))
        self.cache_kwarg = cache_kwarg(model)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: list[int] | None = None
    ) -> torch.Tensor:
        """Logits [B, V] (float32, on the CPU where rows sample) of the last position, extending the cache.

        `rows`: the forward covers only these rows (of the mask and adapter names), e.g. a prefill.
        """
        kwargs: dict[str, Any] = {self.cache_kwarg: self.cache}
        mask, names = self.mask, self.adapter_names
        if rows is not None:
            mask, names = mask[torch.tensor(rows, device=self.device)], [names[i] for i in rows]
        if self.use_adapter_names:
            kwargs["adapter_names"] = names
        # The last position as an index tensor, not `logits_to_keep=1`: the int slices the hidden
        # states into a strided [B, 1, H] view, on which torch's CPU matmul expands the head's weight
        # to [B, H, V] (SmolLM2 bf16, B=32: 7.5 s of a 8 s prefill). The index makes a contiguous copy.
        width = input_ids.shape[1]
        keep: int | torch.Tensor = 1 if width == 1 else torch.tensor([width - 1], device=self.device)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **kwargs,
        )
        return out.logits[:, -1, :].float().cpu()

    def prefill(self) -> torch.Tensor:
        """The logits after every row's prompt; rows with the same prompt and adapter share one forward."""
        first: dict[tuple[Any, ...], int] = {}
        slots = [first.setdefault((r.adapter, *r.prompt_ids), len(first)) for r in self.rows]
        if len(first) == len(self.rows):
            return self.forward(self.input_ids, self.positions)
        owners = [slots.index(slot) for slot in range(len(first))]
        picked = torch.tensor(owners, device=self.device)
        logits = self.forward(self.input_ids[picked], self.positions[picked], rows=owners)
        expand = torch.tensor(slots)
        self.cache.batch_select_indices(expand.to(self.device))
        return logits[expand]

    def run(self, prune_fraction: float) -> None:
        """Decode until every row has finished."""
        logits = self.prefill()
        last = self.positions[:, -1]
        while True:
            next_ids = self.step(logits)
            live = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
            if not live:
                return
            if len(self.rows) - len(live) >= prune_fraction * len(self.rows):
                keep = torch.tensor(live, dtype=torch.long)
                self.select(keep)
                next_ids, last = next_ids[keep], last[keep.to(self.device)]
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
            last = last + 1
            logits = self.forward(next_ids[:, None], last[:, None])

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row and record it (with its logprobs) on the unfinished rows."""
        # Log-probs stay the model's own (what the trainer scores); only sampling sees the grammar.
        logp = torch.log_softmax(logits, dim=-1)
        constrained = [
            i for i, r in enumerate(self.rows) if r.constraint is not None and r.finish_reason is None
        ]
        if constrained:
            logits = logits.clone()
            for i in constrained:
                self.rows[i].constraint.mask_(logits[i])  # type: ignore[union-attr]
        next_ids = sample_next(logits, self.temps, self.top_ps, [r.generator for r in self.rows])
        chosen = logp.gather(1, next_ids[:, None])[:, 0].tolist()
        k = max(r.params.top_logprobs for r in self.rows)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            values, indices = logp.topk(k, dim=-1)
            top_vals, top_ids = values.tolist(), indices.tolist()
        for i, (row, token) in enumerate(zip(self.rows, next_ids.tolist(), strict=True)):
            if row.finish_reason is not None:
                continue
            kr = row.params.top_logprobs
            top = list(zip(top_ids[i][:kr], top_vals[i][:kr], strict=True)) if kr else []
            row.push(token, chosen[i], top, self.tokenizer)
        return next_ids

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (drops finished rows from the cache and every per-row tensor)."""
        self.cache.batch_select_indices(keep.to(self.device))
        self.mask = self.mask[keep.to(self.device)]
        self.temps, self.top_ps = self.temps[keep], self.top_ps[keep]
        kept = keep.tolist()
        self.rows = [self.rows[i] for i in kept]
        self.adapter_names = [self.adapter_names[i] for i in kept]
