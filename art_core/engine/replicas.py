"""Several inference replicas behind one engine: `ReplicatedEngine`, a router over N engines.

`ReplicatedEngine` implements the `Engine` protocol (and streaming, `engine.deltas`) over N engines
of any kind (TorchEngines, VLLMEngines), so the server and `ModelService` use it as they use one:

- **Sticky by rollout.** A request's `GenerationRequest.affinity` (the server sets it from the
  `X-Rollout-Id` header, the rollout-scoped URL, or the OpenAI `user` field) keeps every call of a
  rollout on one replica, whose prefix cache then holds the conversation so far. Without a key the
  prompt's prefix decides: the prompt is hashed in blocks of `RoutingConfig.prefix_block_tokens`
  and a request whose leading blocks cover at least `prefix_match` of it goes where those blocks
  went last (an agent's next turn extends its previous prompt), unless that replica is more than
  `balance_slack_rows` rows busier than the least-loaded one.
- **New rollouts by load.** A key seen for the first time (or whose replica died) goes to the live
  replica with the fewest in-flight rows (a request counts its `n`); ties go round the replicas. A
  replica that refuses a request as full (`EngineOverloadedError`) has it tried on the others (the
  key then stays with the one that took it); only when all refuse does the caller get the error.
- **Publishing.** `add_adapter`/`remove_adapter`/`pause`/`resume` go to every live replica and
  return once all have done it, so an adapter name is served nowhere before it is loaded
  everywhere. `ModelService` publishes a step between `pause()` and `resume()`: no replica runs a
  batch in between, so after `resume()` every replica serves the same step.
- **A replica that dies** (it raises `EngineClosedError`, or it reports `closed`) is marked down:
  its requests that had produced nothing yet are retried on another replica, a stream that had
  already sent tokens fails with `ReplicaDownError`, new requests go to the others and the server
  stays up. A down replica stays down; with none left requests fail with `NoLiveReplicaError`
  (both are `EngineClosedError`s: HTTP 503).

Replicas run where their engines run: TorchEngines in this process each decode on their own worker
thread (torch kernels release the GIL, the Python of the decoding loop does not), a VLLMEngine in
its own engine-core process. Left out: building the replicas (`art_core.host.service`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from art_core.engine.config import EngineStats, GenerationRequest
from art_core.engine.deltas import DeltaStream, RowDelta, token_stream
from art_core.engine.errors import EngineClosedError, EngineOverloadedError
from art_core.engine.protocol import Completion, Engine

logger = logging.getLogger(__name__)


class ReplicaDownError(EngineClosedError):
    """The replica serving a request died after it had streamed tokens, so it could not be retried."""


class NoLiveReplicaError(EngineClosedError):
    """Every replica is down (or the replicated engine was closed)."""


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


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the router sees it."""

    index: int
    """Its position in the replica list."""
    alive: bool
    """False once it was marked down (it stays down)."""
    in_flight_rows: int
    """Rows of its requests not yet answered (a request counts its `n`)."""
    requests: int
    """Requests sent to it so far (retries included)."""
    down_reason: str | None = None
    """Why it was marked down (None while alive)."""


@dataclass
class _Replica:
    engine: Engine
    alive: bool = True
    in_flight: int = 0
    requests: int = 0
    down_reason: str | None = None


@dataclass
class _Memory:
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


class ReplicatedEngine:
    """N engines serving the same model, routed per request (see the module docstring)."""

    def __init__(self, replicas: Sequence[Engine], routing: RoutingConfig | None = None) -> None:
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.routing = routing or RoutingConfig()
        self._replicas = [_Replica(engine) for engine in replicas]
        self.max_context = min(int(r.max_context) for r in replicas)
        self._keys = _Memory(self.routing.max_remembered)
        self._blocks = _Memory(self.routing.max_remembered)
        self._rotation = 0
        self._lock = threading.Lock()
        self._closed = False

    # -- routing ---------------------------------------------------------------------------

    @property
    def replicas(self) -> list[Engine]:
        """The engines, in order (down ones included)."""
        return [r.engine for r in self._replicas]

    def status(self) -> list[ReplicaStatus]:
        """Every replica's liveness and load."""
        with self._lock:
            return [
                ReplicaStatus(i, r.alive, r.in_flight, r.requests, r.down_reason)
                for i, r in enumerate(self._replicas)
            ]

    def live(self) -> list[int]:
        """Indices of the replicas not marked down."""
        with self._lock:
            return [i for i, r in enumerate(self._replicas) if r.alive]

    def mark_down(self, index: int, reason: str) -> None:
        """Take replica `index` out of routing for good (its own requests fail or are retried)."""
        with self._lock:
            replica = self._replicas[index]
            if not replica.alive:
                return
            replica.alive, replica.down_reason = False, reason
            left = sum(r.alive for r in self._replicas)
        logger.error("inference replica %d is down (%s); %d replica(s) left", index, reason, left)

    def _dispatch(self, request: GenerationRequest, exclude: set[int]) -> int:
        """Choose a replica for `request`, count its rows there and remember the choice."""
        routing, rows = self.routing, request.params.n
        blocks = block_hashes(request.prompt_ids, routing.prefix_block_tokens)
        key = None if request.affinity is None else b"key:" + request.affinity.encode()
        with self._lock:
            if self._closed:
                raise NoLiveReplicaError("the replicated engine is closed")
            loads = [
                r.in_flight if r.alive and i not in exclude else None for i, r in enumerate(self._replicas)
            ]
            spare = least_loaded(loads, self._rotation % len(loads))
            if spare is None:
                reasons = "; ".join(f"replica {i}: {r.down_reason}" for i, r in enumerate(self._replicas))
                raise NoLiveReplicaError(f"no inference replica is left to serve this request ({reasons})")
            chosen = self._remembered(key, blocks, len(request.prompt_ids), loads, spare)
            if chosen == spare:  # a fresh choice: the next tie goes to the replica after it
                self._rotation = chosen + 1
            replica = self._replicas[chosen]
            replica.in_flight += rows
            replica.requests += 1
            if key is not None:
                self._keys.put(key, chosen)
            for digest in blocks:
                self._blocks.put(digest, chosen)
        return chosen

    def _remembered(
        self, key: bytes | None, blocks: list[bytes], n_prompt: int, loads: list[int | None], spare: int
    ) -> int:
        """With the lock held: where `key` (or else the prompt's prefix) went before, if it still may go there."""
        if key is not None:
            index = self._keys.get(key)
            return index if index is not None and loads[index] is not None else spare
        block = self.routing.prefix_block_tokens
        for depth in range(len(blocks), 0, -1):
            if depth * block < self.routing.prefix_match * n_prompt:
                break
            index = self._blocks.get(blocks[depth - 1])
            if index is not None:
                load, least = loads[index], loads[spare]
                if load is not None and least is not None and load <= least + self.routing.balance_slack_rows:
                    return index
                break
        return spare

    def _done(self, index: int, request: GenerationRequest) -> None:
        with self._lock:
            self._replicas[index].in_flight -= request.params.n

    def _died(self, index: int, exc: BaseException) -> bool:
        """Whether `exc` from replica `index` means it is dead (then it is marked down)."""
        engine = self._replicas[index].engine
        if not isinstance(exc, EngineClosedError) and not getattr(engine, "closed", False):
            return False
        if self._closed:
            return False
        self.mark_down(index, f"{type(exc).__name__}: {exc}")
        return True

    # -- requests --------------------------------------------------------------------------

    def _full(self, exc: Exception, tried: set[int]) -> bool:
        """Whether `exc` is a full replica's refusal and another live replica is still untried."""
        return isinstance(exc, EngineOverloadedError) and any(i not in tried for i in self.live())

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """The completions from the request's replica; retried elsewhere if that replica dies first
        or is full (`EngineOverloadedError` once every live replica refused it)."""
        tried: set[int] = set()
        while True:
            index = self._dispatch(request, tried)
            try:
                return await self._replicas[index].engine.generate(request)
            except Exception as exc:
                tried.add(index)
                if self._full(exc, tried):
                    continue
                if not self._died(index, exc):
                    raise
                logger.warning("retrying a request of dead replica %d on another replica", index)
            finally:
                self._done(index, request)

    def generate_stream(self, request: GenerationRequest) -> DeltaStream:
        """`generate`, streamed (replicas that cannot stream send their whole completions at once).

        Errors that refuse the request come out of the first `__anext__`. A replica that dies before
        its first increment is replaced; after it, the stream ends with `ReplicaDownError`.
        """
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[list[RowDelta], None]:
        tried: set[int] = set()
        while True:
            index = self._dispatch(request, tried)
            sent = False
            try:
                stream = token_stream(self._replicas[index].engine, request)
                try:
                    async for deltas in stream:
                        sent = True
                        yield deltas
                finally:
                    await stream.aclose()
                return
            except Exception as exc:
                tried.add(index)
                if not sent and self._full(exc, tried):
                    continue
                if not self._died(index, exc):
                    raise
                if sent:
                    raise ReplicaDownError(
                        f"inference replica {index} died while streaming this completion ({exc}); "
                        "the tokens sent so far are all there is: send the request again"
                    ) from exc
                logger.warning("retrying a stream of dead replica %d on another replica", index)
            finally:
                self._done(index, request)

    # -- adapters and lifecycle: every live replica ------------------------------------------

    def _each(self, what: str, call: Any) -> list[Any]:
        """`call(engine)` on every live replica, in order; replicas that turn out dead are marked down."""
        results = []
        for index in self.live():
            engine = self._replicas[index].engine
            if getattr(engine, "closed", False) and not self._closed:
                self.mark_down(index, "its engine is closed")
                continue
            try:
                results.append(call(self._replicas[index].engine))
            except Exception as exc:
                if not self._died(index, exc):
                    raise
        if not self.live():
            raise NoLiveReplicaError(f"no inference replica is left to {what}")
        return results

    def add_adapter(self, name: str, path: Path) -> None:
        """Load adapter `name` on every live replica; returns once all have it."""
        self._each(f"load adapter {name!r}", lambda e: e.add_adapter(name, path))

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name` from every live replica."""
        self._each(f"remove adapter {name!r}", lambda e: e.remove_adapter(name))

    def adapters(self) -> list[str]:
        """The adapters every live replica has loaded."""
        names = self._each("list adapters", lambda e: e.adapters())
        common = set.intersection(*(set(n) for n in names))
        return [n for n in names[0] if n in common]

    def pause(self) -> None:
        """Pause every live replica (each waits for its running batch)."""
        self._each("pause", lambda e: e.pause())

    def resume(self) -> None:
        """Resume every live replica."""
        self._each("resume", lambda e: e.resume())

    def stats(self) -> EngineStats:
        """The replicas' counters summed (largest batch: the largest of any), for those that count."""
        total = EngineStats(0, 0, 0, 0)
        for replica in self._replicas:
            stats = getattr(replica.engine, "stats", None)
            if stats is None:
                continue
            s = stats()
            total = replace(
                total,
                batches=total.batches + s.batches,
                rows=total.rows + s.rows,
                tokens=total.tokens + s.tokens,
                max_batch_rows=max(total.max_batch_rows, s.max_batch_rows),
                merges=total.merges + s.merges,
                aborted=total.aborted + s.aborted,
                joins=total.joins + s.joins,
                joined_rows=total.joined_rows + s.joined_rows,
                prompt_tokens=total.prompt_tokens + s.prompt_tokens,
                cached_prompt_tokens=total.cached_prompt_tokens + s.cached_prompt_tokens,
            )
        return total

    def close(self) -> None:
        """Close every replica (down ones too); later requests fail with NoLiveReplicaError."""
        with self._lock:
            self._closed = True
        for replica in self._replicas:
            try:
                replica.engine.close()
            except Exception:  # one replica failing to close must not keep the others open
                logger.exception("closing an inference replica failed")


__all__ = [
    "NoLiveReplicaError",
    "ReplicaDownError",
    "ReplicaStatus",
    "ReplicatedEngine",
    "RoutingConfig",
    "block_hashes",
    "least_loaded",
]
