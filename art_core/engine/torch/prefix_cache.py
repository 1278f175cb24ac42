"""Keys and values of token sequences decoded before, reused by prompts that start the same way.

An agent resends its whole conversation every turn: turn k's prompt is turn k-1's prompt, the
completion sampled for it and a tool result. A GRPO step sends the same system prompt and
scenario to many rollouts, and they arrive spread over several batches. `PrefixCache` keeps the
keys and values (all layers) of recently prefilled prompts and finished completions, so a
prompt's prefill runs only the tokens past the longest prefix the cache holds (vLLM's automatic
prefix caching, at token granularity).

Memory is bounded by construction: all entries live in one arena, a tensor [layers, 2 (keys,
values), kv_heads, slots, head_dim] in the serving dtype, allocated once at the first store (when
the shapes are known) and never grown; its slots are cut into pages of `block` tokens, as many as
`max_bytes` holds. An entry is a token sequence and the pages holding its keys and values, one
slot per token in order: only the columns of the batch row that hold its tokens are copied, not
the row's padding (positions and rotary follow the token's index in the sequence, not its column,
so the same tokens without padding give the same attention). Evicting an entry returns its pages
to a free list; a store takes free pages, evicting the least recently used entries while too few
are free. Storing thus never allocates memory that outlives it: before the arena, each entry was
copied into small tensors of its own (per layer, keys and values), long-lived and of varied size,
which fragmented glibc's heap until serving RSS was 4-7x the budget (docs/reliability.md).

Lookup: an index maps the hash chain of each whole `block`-token block of an entry to the newest
entry holding that chain. `lookup` follows a prompt's chain as far as it is indexed, then extends
token by token along the entry it reached; the tokens themselves are compared, a hash is never
trusted. A hit names the pages it needs; `fill` then gathers every row's hit from the arena
straight into a batch's empty KV cache (one gather per layer and kind for the whole batch). A hit
is valid until the next `store` (which may reuse its pages). An entry that a newly stored one
extends (a prompt, then its finished completion) is dropped at once.

The keys and values depend on the weights, so a cache is valid for one version of them: the
caller passes a `stamp` of its weights to `for_weights`, which empties the cache when it changed.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from art_core.engine.torch.kv_cache import fill_cache

logger = logging.getLogger(__name__)

BLOCK = 16
"""Tokens per page and per indexed block: lookups find whole blocks by hash, then extend token by token."""

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each [kv_heads, columns, head_dim] for one sequence (`store`,
`keys_values`) or [B, kv_heads, columns, head_dim] for a batch (`store_rows`)."""


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt (valid until the cache's next `store`)."""

    length: int
    """How many leading tokens of the prompt are cached (0: none)."""
    pages: tuple[int, ...]
    """The arena pages holding those tokens, in order (the last one possibly in part); empty when
    `length` is 0."""


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    pages: list[int]
    """The arena pages holding the tokens' keys and values, `block` tokens each, in order."""
    chain: list[int]
    """The hash of each whole block's chain, in order (the index keys this entry was stored under)."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """What the cache did since it was made (clears included)."""

    lookups: int
    looked_up_tokens: int
    """Prompt tokens of all lookups."""
    hit_tokens: int
    """Of those, how many were found cached (the prefill skipped them)."""
    stored: int
    """Sequences stored."""
    evicted: int
    """Entries dropped to free pages for newer ones, or because a newer entry extends them."""
    clears: int
    """Times a new weights stamp emptied the cache."""
    bytes: int
    """Bytes of the arena's pages that entries hold now (the arena itself is at most `max_bytes`)."""


class PrefixCache:
    """Least-recently-used keys and values of token sequences, found by their longest common prefix."""

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) -> entry, oldest first
        self._index: dict[int, _Entry] = {}
        self._arena: torch.Tensor | None = None
        """[layers, 2, kv_heads, pages * block + 1, head_dim]; the last slot stays zero (padding)."""
        self._pages = self._page_bytes = 0
        self._free: list[int] = []
        self._stamp: Hashable = None
        self._counts = {"lookups": 0, "looked_up_tokens": 0, "hit_tokens": 0, "stored": 0}
        self._evicted = self._clears = 0

    def for_weights(self, stamp: Hashable) -> PrefixCache:
        """This cache, emptied first if `stamp` differs from the last one (the weights changed)."""
        if stamp != self._stamp:
            if self._entries:
                self._clears += 1
            self.clear()
            self._stamp = stamp
        return self

    def clear(self) -> None:
        """Drop every entry (the arena stays allocated, all its pages free)."""
        self._entries.clear()
        self._index.clear()
        self._free = list(range(self._pages - 1, -1, -1))

    def stats(self) -> PrefixCacheStats:
        in_use = (self._pages - len(self._free)) * self._page_bytes
        return PrefixCacheStats(**self._counts, evicted=self._evicted, clears=self._clears, bytes=in_use)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of `tokens`, leaving at least the last token uncached (a
        prefill needs one token to compute the next token's logits)."""
        self._counts["lookups"] += 1
        self._counts["looked_up_tokens"] += len(tokens)
        entry, blocks = self._follow(tokens)
        if entry is None or len(tokens) < 2:
            return PrefixHit(0, ())
        start = blocks * self.block
        common = os.path.commonprefix([entry.tokens[start:], tuple(tokens[start:])])
        length = min(start + len(common), len(tokens) - 1)
        if entry.tokens[:length] != tuple(tokens[:length]):  # a hash collision on the chain
            return PrefixHit(0, ())
        self._entries.move_to_end(id(entry))
        self._counts["hit_tokens"] += length
        return PrefixHit(length, tuple(entry.pages[: -(-length // self.block)]))

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of `tokens` (storing them would add nothing); marks it used."""
        key = tuple(tokens)
        holder, _ = self._follow(key)
        if holder is None or holder.tokens[: len(key)] != key:
            return False
        self._entries.move_to_end(id(holder))
        return True

    def keys_values(self, hit: PrefixHit) -> list[LayerKV]:
        """Copies of a hit's keys and values: per layer, [kv_heads, hit.length, head_dim] each."""
        if hit.length == 0 or self._arena is None:
            return []
        slots = self._slots(hit.pages, hit.length)
        return [(layer[0].index_select(1, slots), layer[1].index_select(1, slots)) for layer in self._arena]

    def fill(self, cache: DynamicCache, hits: Sequence[PrefixHit]) -> torch.Tensor:
        """Write each hit's keys and values into row i of the empty `cache`, right-aligned at the
        longest hit (zeros on the left); returns the batch's mask [len(hits), longest] (1 on tokens)."""
        if self._arena is None or not any(hit.length for hit in hits):
            raise ValueError("fill needs at least one hit on a cache that holds entries")
        width, padding = max(hit.length for hit in hits), self._arena.shape[-2] - 1
        device = self._arena.device
        slots = torch.full((len(hits), width), padding, dtype=torch.long, device=device)
        mask = torch.zeros((len(hits), width), dtype=torch.long, device=device)
        for row, hit in enumerate(hits):
            if hit.length:
                slots[row, width - hit.length :] = self._slots(hit.pages, hit.length)
                mask[row, width - hit.length :] = 1
        fill_cache(cache, self._arena, slots)
        return mask

    def store(self, tokens: Sequence[int], layers: list[LayerKV], mask: torch.Tensor) -> None:
        """Copy `tokens`' keys and values into the arena: per layer, tensors [kv_heads, columns,
        head_dim] (a batch row's views; only read here), and `mask` [columns], true on the columns
        that hold the tokens (in order).

        Sequences shorter than one block are not kept (no lookup could find them), nor sequences
        an entry already holds whole, nor sequences longer than the whole arena. Entries that this
        one extends are dropped; then the least recently used ones until enough pages are free.
        """
        batch = [(keys[None], values[None]) for keys, values in layers]
        self.store_rows(batch, [0], [tokens], mask[None])

    def store_rows(
        self,
        layers: list[LayerKV],
        rows: Sequence[int],
        sequences: Sequence[Sequence[int]],
        mask: torch.Tensor,
    ) -> None:
        """`store` of several rows of one batch, in order: `layers` are the batch's keys and values
        (per layer, [B, kv_heads, columns, head_dim]; only read here), row `rows[i]` holds
        `sequences[i]` on the columns where `mask[rows[i]]` [B, columns] is true.

        The entries are placed row by row as `store` places them; their keys and values are then
        copied in one gather and one scatter per layer and kind for all rows (a row at a time, 32
        finished rows of SmolLM2 took 3,840 small copies, ~0.2-0.3 s, 3-5% of a round of
        `bench/serve_throughput.py`). A row whose entry a later row of the same call evicted is
        not copied: its pages belong to the later one.
        """
        widths = {keys.shape[-2] for keys, _ in layers}
        if widths != {mask.shape[-1]}:
            raise ValueError(
                f"keys as wide as the mask needed: {sorted(widths)} columns against {mask.shape[-1]}"
            )
        held = [mask[row].bool().nonzero()[:, 0] for row in rows]
        # Every row is checked before any is placed: a placed entry's pages are written only at the end.
        for row, tokens, columns in zip(rows, sequences, held, strict=True):
            if len(columns) != len(tokens):
                raise ValueError(
                    f"{len(tokens)} tokens need as many unmasked columns, row {row} has {len(columns)}"
                )
        placed: list[tuple[_Entry, int, torch.Tensor]] = []
        for row, tokens, columns in zip(rows, sequences, held, strict=True):
            entry = self._place(tuple(int(t) for t in tokens), layers)
            if entry is not None:
                placed.append((entry, row, columns))
        kept = [(entry, row, columns) for entry, row, columns in placed if id(entry) in self._entries]
        if kept:
            self._write(kept, layers)

    def _place(self, key: tuple[int, ...], layers: list[LayerKV]) -> _Entry | None:
        """A new entry for `key` with its pages, indexed (its keys and values not yet written);
        None where `store` keeps nothing."""
        if len(key) < self.block or self.holds(key) or not self._ensure_arena(layers):
            return None
        needed = -(-len(key) // self.block)
        if needed > self._pages:
            return None
        chain = self._chain(key)
        for link in chain:
            older = self._index.get(link)
            if older is not None and key[: len(older.tokens)] == older.tokens:
                self._evict(older)  # this entry holds all of it
        while len(self._free) < needed:
            self._evict(next(iter(self._entries.values())))
        entry = _Entry(key, [self._free.pop() for _ in range(needed)], chain)
        for link in chain:
            self._index[link] = entry
        self._entries[id(entry)] = entry
        self._counts["stored"] += 1
        return entry

    def _ensure_arena(self, layers: list[LayerKV]) -> bool:
        """Allocate the arena for keys shaped like `layers`' on the first store; False if not even
        one page fits the budget. Raises ValueError for keys of another shape while entries are held."""
        keys = layers[0][0]
        heads, dim = keys.shape[-3], keys.shape[-1]
        shape = (len(layers), 2, heads, dim)
        arena = self._arena
        if arena is not None:
            if (*arena.shape[:3], arena.shape[-1], arena.dtype, arena.device) == (
                *shape,
                keys.dtype,
                keys.device,
            ):
                return self._pages > 0
            if self._entries:
                raise ValueError(
                    f"keys {tuple(keys.shape)} {keys.dtype} do not fit the arena {tuple(arena.shape)}"
                )
        token_bytes = len(layers) * 2 * heads * dim * keys.element_size()
        self._page_bytes = token_bytes * self.block
        self._pages = max(0, (self.max_bytes - token_bytes) // self._page_bytes)  # the padding slot fits too
        if self._pages == 0:
            logger.warning(
                "prefix cache: a page of %d tokens takes %d bytes, more than the budget of %d; caching nothing",
                self.block,
                self._page_bytes,
                self.max_bytes,
            )
        # Not an inference tensor, so that it can be written inside and outside inference mode.
        with torch.inference_mode(False):
            self._arena = keys.new_empty((len(layers), 2, heads, self._pages * self.block + 1, dim))
            self._arena[..., -1, :] = 0  # the padding slot
        self.clear()
        return self._pages > 0

    def _write(self, placed: list[tuple[_Entry, int, torch.Tensor]], layers: list[LayerKV]) -> None:
        """Copy each (entry, batch row, its token columns) of `placed` from `layers` into the entry's pages."""
        assert self._arena is not None
        device = self._arena.device
        slots = torch.cat([self._slots(entry.pages, len(entry.tokens)) for entry, _, _ in placed])
        rows = torch.cat([torch.full((len(columns),), row, device=device) for _, row, columns in placed])
        columns = torch.cat([columns for _, _, columns in placed]).to(device)
        with torch.no_grad():
            for target, (keys, values) in zip(self._arena, layers, strict=True):
                for kind, source in enumerate((keys, values)):
                    target[kind].index_copy_(1, slots, source[rows, :, columns].transpose(0, 1))

    def _slots(self, pages: Sequence[int], length: int) -> torch.Tensor:
        """The arena slots of the first `length` tokens held in `pages`, in order."""
        assert self._arena is not None
        device = self._arena.device
        starts = torch.tensor(pages, dtype=torch.long, device=device)[:, None] * self.block
        return (starts + torch.arange(self.block, device=device)).flatten()[:length]

    def _evict(self, entry: _Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._evicted += 1
        for link in entry.chain:
            if self._index.get(link) is entry:
                del self._index[link]
        self._free.extend(entry.pages)

    def _chain(self, tokens: Sequence[int]) -> list[int]:
        """The chained hash of each whole block of `tokens`."""
        links, link = [], 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            link = hash((link, tuple(tokens[start : start + self.block])))
            links.append(link)
        return links

    def _follow(self, tokens: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry the index reaches along `tokens`' block chain, and how many blocks matched."""
        entry, blocks, link = None, 0, 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            link = hash((link, tuple(tokens[start : start + self.block])))
            found = self._index.get(link)
            if found is None:
                break
            entry, blocks = found, blocks + 1
        return entry, blocks
