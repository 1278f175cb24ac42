"""Where `ReplicatedEngine` (engine.replicas) sends a request: `RoutingConfig` and the pure pieces.

`block_hashes` chains digests of a prompt's leading blocks, so that a later prompt extending it
finds where it went; `least_loaded` picks the live replica with the fewest in-flight rows, ties
going round; `Memory` remembers affinity keys and blocks, least recently used forgotten first.
Left out: the router itself and its locking (`engine.replicas`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoutingConfig:
    """How `ReplicatedEngine` picks a replica for a request."""

    prefix_block_tokens: int = 32
    """Requests without an affinity key are matched by their prompt's leading blocks of this many tokens."""
    prefix_match: float = 0.5
    """...and follow the replica of an earlier prompt when the matching blocks cover at least this
    fraction of their prompt (below it, a shared system prompt alone would send everyone to one replica)."""
    balance_slack_rows: int = 8
    """A prefix match is ignored when its replica has more than this many in-flight rows above the
    least-loaded live one (affinity keys are always followed while their replica lives)."""
    max_remembered: int = 65536
    """Affinity keys and prompt blocks remembered (least recently used ones are forgotten first)."""

    def __post_init__(self) -> None:
        if self.prefix_block_tokens < 1:
            raise ValueError(f"prefix_block_tokens must be >= 1, got {self.prefix_block_tokens}")
        if not 0 < self.prefix_match <= 1:
            raise ValueError(f"prefix_match must be in (0, 1], got {self.prefix_match}")
        if self.balance_slack_rows < 0:
            raise ValueError(f"balance_slack_rows must be >= 0, got {self.balance_slack_rows}")
        if self.max_remembered < 1:
            raise ValueError(f"max_remembered must be >= 1, got {self.max_remembered}")


@dataclass
class Memory:
    """Least-recently-used map of affinity keys and prompt blocks to replica indices."""

    limit: int
    entries: OrderedDict[bytes, int] = field(default_factory=OrderedDict)

    def get(self, key: bytes) -> int | None:
        index = self.entries.get(key)
        if index is not None:
            self.entries.move_to_end(key)
        return index

    def put(self, key: bytes, index: int) -> None:
        self.entries[key] = index
        self.entries.move_to_end(key)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)


def block_hashes(prompt_ids: Sequence[int], block: int) -> list[bytes]:
    """Chained digests of the prompt's whole leading blocks: entry i identifies tokens [0, (i+1)*block)."""
    out: list[bytes] = []
    digest = b""
    for end in range(block, len(prompt_ids) + 1, block):
        chunk = ",".join(map(str, prompt_ids[end - block : end])).encode()
        digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
        out.append(digest)
    return out


def least_loaded(loads: Sequence[int | None], start: int) -> int | None:
    """The index with the smallest load (None entries are down), ties broken from `start` on; None if all are down."""
    n = len(loads)
    best: int | None = None
    for offset in range(n):
        i = (start + offset) % n
        load = loads[i]
        if load is not None and (best is None or load < loads[best]):  # type: ignore[operator]
            best = i
    return best


__all__ = ["Memory", "RoutingConfig", "block_hashes", "least_loaded"]
