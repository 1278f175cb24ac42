"""Keys and values of token sequences decoded before, reused by prompts that start the same way.

An agent resends its whole conversation every turn: turn k's prompt is turn k-1's prompt, the
completion sampled for it and a tool result. A GRPO step sends the same system prompt and
scenario to many rollouts, and they arrive spread over several batches. `PrefixCache` keeps the
keys and values (all layers) of recently prefilled prompts and finished completions, so a
prompt's prefill runs only the tokens past the longest prefix the cache holds (vLLM's automatic
prefix caching, at token granularity).

An entry is a token sequence and, per layer, its keys and values as the decoding batch's row
held them (from its first token on), with the row's column mask: a batch row holds its tokens in
order, with padding columns in between where its prefill padded it. Each row is copied out of
the batch into tensors of its own (one copy per layer and kind: 30-76 ms for 32 rows of 100
tokens of SmolLM2), not viewed: a view would keep the batch's whole buffer alive for one row,
and a batch of long rows can outweigh the whole budget. The cache's memory is counted per
buffer its entries view (callers that store views of one buffer have it counted once).

Lookup: an index maps the hash chain of each whole `block`-token block of an entry to the newest
entry holding that chain. `lookup` follows a prompt's chain as far as it is indexed, then extends
token by token along the entry it reached; the tokens themselves are compared, a hash is never
trusted. Entries are evicted least recently used first once the buffers they view hold more than
`max_bytes`; an entry that a newly stored one extends (a prompt, then its finished completion)
is dropped at once.

The keys and values depend on the weights, so a cache is valid for one version of them: the
caller passes a `stamp` of its weights to `for_weights`, which empties the cache when it changed.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

BLOCK = 16
"""Tokens per indexed block: lookups find whole blocks by hash, then extend token by token."""

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values of one sequence, each [kv_heads, columns, head_dim]."""


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt."""

    length: int
    """How many leading tokens of the prompt are cached (0: none)."""
    layers: list[LayerKV]
    """Per layer, the keys and values of those tokens: views [kv_heads, columns, head_dim] of the
    cache's entry (read them, never write them); empty when `length` is 0."""
    mask: torch.Tensor | None
    """[columns] bool: which columns hold the tokens (in order; the others are padding)."""


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    layers: list[LayerKV]
    mask: torch.Tensor
    ends: list[int]
    """ends[j]: the column after the one holding token j (a prefix of j + 1 tokens spans ends[j])."""
    chain: list[int]
    """The hash of each whole block's chain, in order (the index keys this entry was stored under)."""
    buffers: list[tuple[int, int]]
    """(address, bytes) of every buffer its views point into."""


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
    """Entries dropped to stay under `max_bytes`, or because a newer entry extends them."""
    clears: int
    """Times a new weights stamp emptied the cache."""
    bytes: int
    """Bytes of the buffers the entries view now."""


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
        self._buffers: dict[int, list[int]] = {}  # address -> [entries viewing it, bytes]
        self._stamp: Hashable = None
        self._bytes = 0
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
        """Drop every entry."""
        self._entries.clear()
        self._index.clear()
        self._buffers.clear()
        self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(**self._counts, evicted=self._evicted, clears=self._clears, bytes=self._bytes)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of `tokens`, leaving at least the last token uncached (a
        prefill needs one token to compute the next token's logits)."""
        self._counts["lookups"] += 1
        self._counts["looked_up_tokens"] += len(tokens)
        entry, blocks = self._follow(tokens)
        if entry is None or len(tokens) < 2:
            return PrefixHit(0, [], None)
        start = blocks * self.block
        common = os.path.commonprefix([entry.tokens[start:], tuple(tokens[start:])])
        length = min(start + len(common), len(tokens) - 1)
        if entry.tokens[:length] != tuple(tokens[:length]):  # a hash collision on the chain
            return PrefixHit(0, [], None)
        self._entries.move_to_end(id(entry))
        self._counts["hit_tokens"] += length
        width = entry.ends[length - 1]
        layers = [(keys[:, :width], values[:, :width]) for keys, values in entry.layers]
        return PrefixHit(length, layers, entry.mask[:width])

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of `tokens` (storing them would add nothing); marks it used."""
        key = tuple(tokens)
        holder, _ = self._follow(key)
        if holder is None or holder.tokens[: len(key)] != key:
            return False
        self._entries.move_to_end(id(holder))
        return True

    def store(self, tokens: Sequence[int], layers: list[LayerKV], mask: torch.Tensor) -> None:
        """Keep `tokens` with their keys and values: per layer, tensors [kv_heads, columns, head_dim]
        that the caller never writes again (the cache keeps them, not copies), and `mask`
        [columns], true on the columns that hold the tokens (in order).

        Sequences shorter than one block are not kept (no lookup could find them), nor sequences
        an entry already holds whole. Entries that this one extends are dropped.
        """
        mask = mask.bool()
        ends = (mask.nonzero()[:, 0] + 1).tolist()
        if len(ends) != len(tokens) or any(keys.shape[-2] != mask.shape[0] for keys, _ in layers):
            raise ValueError(
                f"{len(tokens)} tokens need as many unmasked columns, and keys as wide as the mask "
                f"({mask.shape[0]} columns, {len(ends)} unmasked)"
            )
        if len(tokens) < self.block:
            return
        key = tuple(int(t) for t in tokens)
        if self.holds(key):
            return
        buffers = {}
        for keys, values in layers:
            for view in (keys, values):
                storage = view.untyped_storage()
                buffers[storage.data_ptr()] = storage.nbytes()
        entry = _Entry(key, list(layers), mask, ends, self._chain(key), list(buffers.items()))
        for link in entry.chain:
            older = self._index.get(link)
            if older is not None and older is not entry and key[: len(older.tokens)] == older.tokens:
                self._evict(older)  # this entry holds all of it
            self._index[link] = entry
        self._entries[id(entry)] = entry
        for address, size in entry.buffers:
            count = self._buffers.setdefault(address, [0, size])
            if count[0] == 0:
                self._bytes += size
            count[0] += 1
        self._counts["stored"] += 1
        while self._bytes > self.max_bytes and self._entries:
            self._evict(next(iter(self._entries.values())))

    def _evict(self, entry: _Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._evicted += 1
        for link in entry.chain:
            if self._index.get(link) is entry:
                del self._index[link]
        for address, size in entry.buffers:
            count = self._buffers[address]
            count[0] -= 1
            if count[0] == 0:
                del self._buffers[address]
                self._bytes -= size

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
