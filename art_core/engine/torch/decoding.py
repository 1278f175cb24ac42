"""Decoding a padded batch: the per-row state and the prefill + token-by-token loop.

`DecodeBatch` left-pads the prompts of its rows, prefills them into a transformers
`DynamicCache` and decodes one token per step for every row until all rows have finished,
under whatever grad/eval mode the caller set (the engine uses `torch.inference_mode` and eval
mode). With a peft model it passes `adapter_names` (one per row, "__base__" for the base model)
to every forward, so rows with different LoRA adapters share the batch. Rows with the same
prompt prefix and adapter (a shared system prompt; the n completions of a request, a GRPO
group) prefill that prefix once and copy its cache rows. Between steps, rows that arrived
meanwhile can join the running batch (continuous batching): they are prefilled together and their cache is joined to the batch's
(`art_core.engine.torch.kv_cache`); finished rows are reported at once and dropped from the batch once
enough have piled up, and the left columns none of the remaining rows uses go with them (a batch
that never empties keeps the width of its rows, not of its whole life). Each row's text and stop strings are its `IncrementalDetokenizer`'s
(`art_core.engine.detokenizer`). Left out: which rows run or join (`scheduler`, `engine`). See
docs/architecture.md ("The torch engine").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from art_core.engine.detokenizer import IncrementalDetokenizer
from art_core.engine.finish_reason import FinishReason
from art_core.engine.grammar import RowConstraint
from art_core.engine.protocol import Completion
from art_core.engine.sampling import SamplingParams, chosen_logprobs, sample_next, top_logprobs
from art_core.engine.torch.decode_step import (
    decode_step,
    prefill_step,
    supports_decode_step,
    supports_prefill_step,
)
from art_core.engine.torch.kv_cache import (
    cache_kwarg,
    drop_leading_columns,
    growing_cache,
    join_caches,
    joinable,
    layer_views,
)
from art_core.engine.torch.prefix_cache import PrefixCache, PrefixHit
from art_core.engine.torch.scheduler import MIN_SHARED_PROMPT as MIN_SHARED_PROMPT
from art_core.engine.torch.scheduler import shared_prompt_length as shared_prompt_length
from art_core.engine.torch.threads import ThreadTuner, apply

BASE_ADAPTER = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch."""

MIN_DROPPED_COLUMNS = 64
"""`DecodeBatch.select` drops the unused left columns of the cache once there are at least this
many and at least half its width: each copy of the cache then pays for as many steps as it
saves, and the cache stays under twice the width its rows need (plus this)."""


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
    finish_reason: FinishReason | None = None
    constraint: RowConstraint | None = None
    """The row's grammar state when its request is constrained (JSON schema, forced tool call)."""
    on_token: Callable[[RowState], bool] | None = None
    """Called after each recorded token (finish_reason already decided), on the decoding thread:
    streams it; returning False ends the row with finish_reason ABORT (its request was cancelled)."""
    detokenizer: IncrementalDetokenizer | None = None
    """The row's text (made on first use): fed every token when the row has stop strings, else all
    at once when the completion is asked for."""

    @property
    def cancelled(self) -> bool:
        """Nobody waits for the row any more (its request was cancelled or already answered)."""
        return bool(getattr(self.job, "done", False))

    def push(self, token: int, logprob: float, top: list[tuple[int, float]], tokenizer: Any) -> None:
        """Record a sampled token and decide whether the row is finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.top.append(top)
        if self.constraint is not None and token not in self.stop_ids:
            self.constraint.consume(token)
        if token in self.stop_ids:
            self.finish_reason = FinishReason.STOP
        elif self.params.stop and self._reaches_stop_string(token, tokenizer):
            self.finish_reason = FinishReason.STOP
        elif len(self.token_ids) >= self.max_new:
            self.finish_reason = FinishReason.LENGTH
        if self.on_token is not None and not self.on_token(self) and self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT

    def _text(self, tokenizer: Any) -> IncrementalDetokenizer:
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.stop)
        return self.detokenizer

    def _reaches_stop_string(self, token: int, tokenizer: Any) -> bool:
        text = self._text(tokenizer)
        text.feed((token,))
        return text.stopped

    def completion(self, tokenizer: Any) -> Completion:
        """The row's completion, once `finish_reason` is set (asking again gives the same one)."""
        ids = self.token_ids
        if self.finish_reason is FinishReason.STOP and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]  # the stop id ends the row; it is not text
        text = self._text(tokenizer)
        if not text.finished:  # the stream asks when the row ends, the engine again to answer it
            text.feed(ids[len(text.ids) :])
            text.finish()
        return Completion(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top),
            text=text.text,
            finish_reason=self.finish_reason or FinishReason.LENGTH,
        )


class DecodeBatch:
    """One left-padded batch: prefill, then token-by-token decoding with a DynamicCache."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        rows: list[RowState],
        use_adapter_names: bool,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model, self.tokenizer, self.rows = model, tokenizer, list(rows)
        self.use_adapter_names = use_adapter_names
        self.prefix_cache = prefix_cache
        """Where prompts look up their cached prefixes and prompts and finished rows are stored;
        valid for `model`'s current weights (the caller's duty: `PrefixCache.for_weights`)."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_id = int(pad)
        self.input_ids, self.mask = _left_padded([r.prompt_ids for r in rows], self.pad_id)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.device = next(model.parameters()).device
        self.input_ids, self.mask, self.positions = (
            t.to(self.device) for t in (self.input_ids, self.mask, self.positions)
        )
        self.temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        self.top_ps = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        self.adapter_names = [r.adapter or BASE_ADAPTER for r in rows]
        self.cache = growing_cache(model.config, room=max(r.max_new for r in rows))
        if not joinable(self.cache):  # other layer kinds (sliding windows) may rewrite their columns
            self.prefix_cache = None
        self.cache_kwarg = cache_kwarg(model)
        self.lean = not use_adapter_names and supports_decode_step(model)
        """Decode steps run `decode_step` instead of transformers' forward (same modules, same math)."""
        self.lean_prefill = self.lean and supports_prefill_step(model)
        """Prefills run `prefill_step`: the decode steps' (packed) weights, no per-call machinery."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[int] | None = None,
        mask: torch.Tensor | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Logits [B, V] (float32, on the CPU where rows sample) of the last position, extending the cache.

        `rows`: the forward covers only these rows (of the mask and adapter names), e.g. a prefill.
        `mask`: the attention mask to use instead of the batch's (with `rows`: already selected).
        `logits=False`: nobody reads them (a shared prefix); the lean prefill skips the head, and
        returns an empty tensor.

        One token a row runs `decode_step` (a decode step, or a prompt cached but for its last
        token), more `prefill_step`, where the model has them; else transformers' forward.
        """
        if mask is None:
            mask = self.mask if rows is None else self.mask[torch.tensor(rows, device=self.device)]
        if self.lean and input_ids.shape[1] == 1:
            return decode_step(self.model, input_ids.to(self.device), positions, mask, self.cache).cpu()
        if self.lean_prefill:
            out = prefill_step(
                self.model, input_ids.to(self.device), positions, mask, self.cache, logits=logits
            )
            return torch.empty(0) if out is None else out.cpu()
        kwargs: dict[str, Any] = {self.cache_kwarg: self.cache}
        names = self.adapter_names
        if rows is not None:
            names = [names[i] for i in rows]
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
        """The logits after every row's prompt.

        Rows with the same prompt and adapter (the n completions of a request, a GRPO group) share
        one forward and copy its cache rows. The distinct prompts then skip what they can: the
        longest prefix each has in the prefix cache (`PrefixCache`; prompts seen before, an
        agent's previous turns), or, when that saves less, their common prefix (a system prompt;
        all of one adapter) run once (`shared_prompt_length`). Each distinct prompt is then stored
        in the prefix cache.
        """
        first: dict[tuple[Any, ...], int] = {}
        slots = [first.setdefault((r.adapter, *r.prompt_ids), len(first)) for r in self.rows]
        owners = [slots.index(slot) for slot in range(len(first))]
        if len(owners) < len(self.rows):  # the forward covers the owners; their copies come after
            picked = torch.tensor(owners, device=self.device)
            self.input_ids, self.mask, self.positions = (
                self.input_ids[picked],
                self.mask[picked],
                self.positions[picked],
            )
        rows = [self.rows[i] for i in owners]
        hits = [self.prefix_cache.lookup(r.prompt_ids) for r in rows] if self.prefix_cache is not None else []
        shared = shared_prompt_length(rows)
        if sum(hit.length for hit in hits) > shared * (len(rows) - 1):
            logits = self._prefill_cached(owners, hits)
        elif shared:
            logits = self._prefill_shared(shared, owners)
        else:
            logits = self.forward(self.input_ids, self.positions, rows=owners, mask=self.mask)
        self._remember(list(range(len(rows))), [r.prompt_ids for r in rows])
        if len(owners) == len(self.rows):
            return logits
        expand = torch.tensor(slots)
        on_device = expand.to(self.device)
        self.cache.batch_select_indices(on_device)
        self.mask, self.positions = self.mask[on_device], self.positions[on_device]
        return logits[expand]

    def _prefill_cached(self, owners: list[int], hits: list[PrefixHit]) -> torch.Tensor:
        """Logits of rows `owners` (one per distinct prompt) whose leading tokens `hits` found
        cached: their keys and values go into the cache as they are, and the forward runs each
        row's other tokens on top of them. The batch's mask and positions become the owners'.

        Each row's cache then holds [left padding | its cached prefix | left padding | the rest of
        its prompt]; the mask hides the padding and positions continue from the prefix.
        """
        assert self.prefix_cache is not None
        rows = [self.rows[i] for i in owners]
        past_mask = self.prefix_cache.fill(self.cache, hits)
        rests = [r.prompt_ids[hit.length :] for r, hit in zip(rows, hits, strict=True)]
        ids, own_mask = _left_padded(rests, self.pad_id)
        own_mask = own_mask.to(self.device)
        cached = torch.tensor([hit.length for hit in hits], device=self.device)
        self.mask = torch.cat([past_mask, own_mask], dim=1)
        self.positions = cached[:, None] + (own_mask.cumsum(-1) - 1).clamp(min=0)
        return self.forward(ids, self.positions, rows=owners, mask=self.mask)

    def _remember(self, cache_rows: list[int], sequences: list[list[int]]) -> None:
        """Store in the prefix cache what `cache_rows` of the batch's cache hold: `sequences`. The
        cache copies the columns holding each row's tokens into pages of its arena (all rows in one
        copy per layer and kind), so its budget evicts row by row and no cached row keeps the
        batch's buffers alive."""
        if self.prefix_cache is None or not cache_rows:
            return
        self.prefix_cache.store_rows(layer_views(self.cache), cache_rows, sequences, self.mask)

    def _prefill_shared(self, shared: int, owners: list[int]) -> torch.Tensor:
        """Logits of rows `owners` (one per distinct prompt), whose first `shared` prompt tokens are
        the same: prefill that prefix once, copy its cache to every owner, then prefill each
        owner's rest on top of it. The batch's mask and positions become the owners'.

        Each row's cache then holds [the shared prefix | left padding | its own prompt tokens]; the
        mask hides the padding and positions continue from the prefix, so attention and rotary
        positions are those of the row's whole prompt.
        """
        rows = [self.rows[i] for i in owners]
        prefix = torch.tensor([rows[0].prompt_ids[:shared]], device=self.device)
        steps = torch.arange(shared, device=self.device)[None]
        self.forward(prefix, steps, rows=owners[:1], mask=torch.ones_like(prefix), logits=False)
        self.cache.batch_select_indices(torch.zeros(len(rows), dtype=torch.long, device=self.device))
        ids, own_mask = _left_padded([r.prompt_ids[shared:] for r in rows], self.pad_id)
        own_mask = own_mask.to(self.device)
        prefix_mask = torch.ones((len(rows), shared), dtype=torch.long, device=self.device)
        self.mask = torch.cat([prefix_mask, own_mask], dim=1)
        self.positions = shared + (own_mask.cumsum(-1) - 1).clamp(min=0)
        return self.forward(ids, self.positions, rows=owners, mask=self.mask)

    def run(
        self,
        prune_fraction: float,
        admit: Callable[[int], list[RowState]] | None = None,
        finished: Callable[[list[RowState]], None] | None = None,
        max_rows: int | None = None,
        threads: ThreadTuner | None = None,
    ) -> None:
        """Decode until every row has finished and no more rows join.

        `admit(room)` is asked between steps for up to `room` more rows (room = `max_rows` minus
        the unfinished rows), which are prefilled on their own and join the running batch: the
        shorter of the two caches is left-padded (continuous batching). `finished(rows)` is
        called with the rows that finished at each step, so their requests need not wait for
        the whole batch. `threads` times each decode step and sets the thread count of the next
        (`art_core.engine.torch.threads`); None leaves torch's as it is.
        """
        logits = self.prefill()
        last = self.positions[:, -1]
        limit = max_rows or len(self.rows)
        join = admit if admit is not None and joinable(self.cache) else None
        while True:
            before = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
            next_ids = self.step(logits)
            ended = [i for i in before if self.rows[i].finish_reason is not None]
            # Answer first, then cache what the ended rows hold: each one's prompt and its tokens
            # but the last (never fed back).
            _report([self.rows[i] for i in before], finished)
            self._remember(ended, [self.rows[i].prompt_ids + self.rows[i].token_ids[:-1] for i in ended])
            live = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
            joiners = join(limit - len(live)) if join is not None and len(live) < limit else []
            if not live and not joiners:
                return
            done = len(self.rows) - len(live)
            if done and (joiners or not live or done >= prune_fraction * len(self.rows)):
                keep = torch.tensor(live, dtype=torch.long)
                self.select(keep)
                next_ids, last = next_ids[keep], last[keep.to(self.device)]
            if joiners:
                next_ids, last = self._join(joiners, next_ids, last, finished)
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
            last = last + 1
            started = time.perf_counter()
            logits = self.forward(next_ids[:, None], last[:, None])
            if threads is not None:
                apply(threads.record(len(self.rows), time.perf_counter() - started))

    def _join(
        self,
        rows: list[RowState],
        next_ids: torch.Tensor,
        last: torch.Tensor,
        finished: Callable[[list[RowState]], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `rows`, sample their first tokens and append them to this batch (possibly empty)."""
        newcomers = DecodeBatch(self.model, self.tokenizer, rows, self.use_adapter_names, self.prefix_cache)
        first = newcomers.step(newcomers.prefill())
        _report(rows, finished)
        if not self.rows:  # everyone before them has finished: the newcomers become the batch
            self.cache, self.mask = newcomers.cache, newcomers.mask
        else:
            width = join_caches(self.cache, newcomers.cache)
            self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(newcomers.mask, width)])
        self.rows += newcomers.rows
        self.temps = torch.cat([self.temps, newcomers.temps])
        self.top_ps = torch.cat([self.top_ps, newcomers.top_ps])
        self.adapter_names += newcomers.adapter_names
        return torch.cat([next_ids, first]), torch.cat([last, newcomers.positions[:, -1]])

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row and record it (with its logprobs) on the unfinished rows."""
        # Log-probs stay the model's own (what the trainer scores); only sampling sees the grammar.
        probs = torch.softmax(logits, dim=-1)
        constrained = [
            i for i, r in enumerate(self.rows) if r.constraint is not None and r.finish_reason is None
        ]
        sampled = logits
        if constrained:
            sampled = logits.clone()
            for i in constrained:
                self.rows[i].constraint.mask_(sampled[i])  # type: ignore[union-attr]
        generators = [r.generator for r in self.rows]
        next_ids = sample_next(sampled, self.temps, self.top_ps, generators, None if constrained else probs)
        chosen = chosen_logprobs(logits, probs, next_ids)
        k = max(r.params.top_logprobs for r in self.rows)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            values, indices = top_logprobs(logits, probs, next_ids, chosen, k)
            top_vals, top_ids = values.tolist(), indices.tolist()
        chosen_list = chosen.tolist()
        for i, (row, token) in enumerate(zip(self.rows, next_ids.tolist(), strict=True)):
            if row.finish_reason is not None:
                continue
            kr = row.params.top_logprobs
            top = list(zip(top_ids[i][:kr], top_vals[i][:kr], strict=True)) if kr else []
            row.push(token, chosen_list[i], top, self.tokenizer)
        return next_ids

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (drops finished rows from the cache and every per-row tensor)."""
        self.cache.batch_select_indices(keep.to(self.device))
        self.mask = self.mask[keep.to(self.device)]
        self.temps, self.top_ps = self.temps[keep], self.top_ps[keep]
        kept = keep.tolist()
        self.rows = [self.rows[i] for i in kept]
        self.adapter_names = [self.adapter_names[i] for i in kept]
        self._drop_unused_columns()

    def _drop_unused_columns(self) -> None:
        """Drop the left columns that every row masks (what rows that left the batch had used),
        when there are enough of them (`MIN_DROPPED_COLUMNS`)."""
        if not self.rows or not joinable(self.cache):
            return
        unused = int(self.mask.any(dim=0).int().argmax())  # the first column a row uses
        if unused >= max(MIN_DROPPED_COLUMNS, self.mask.shape[1] // 2):
            drop_leading_columns(self.cache, unused)
            self.mask = self.mask[:, unused:]


def _report(rows: list[RowState], finished: Callable[[list[RowState]], None] | None) -> None:
    """Tell `finished` which of `rows` (unfinished before the step) have finished now."""
    done = [r for r in rows if r.finish_reason is not None]
    if done and finished is not None:
        finished(done)


def _left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one left-padded [B, longest] batch of ids, and its mask (1 on tokens)."""
    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, tokens in enumerate(sequences):
        ids[i, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
        mask[i, width - len(tokens) :] = 1
    return ids, mask


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """An attention mask [B, L] left-padded with zeros to [B, width]."""
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))
