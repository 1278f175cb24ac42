"""Several inference replicas behind one engine: `ReplicatedEngine`, a router over N engines.

`ReplicatedEngine` implements the `Engine` protocol (and streaming, `engine.deltas`) over N engines
of any kind (TorchEngines, VLLMEngines), so the server and `ModelService` use it as they use one:

- **Sticky by rollout.** A request's `GenerationRequest.affinity` (the server sets it from the
  `X-Rollout-Id` header, the rollout-scoped URL, or the OpenAI `user` field) keeps every call of a
  rollout on one replica, whose prefix cache then holds the conversation so far. Without a key the
  prompt's prefix decides: the prompt is hashed in blocks of `RoutingConfig.prefix_block_tokens`
  and a request whose leading blocks cover at least `prefix_match` of it goes where those blocks
  went last (an agent's next turn extends its previous prompt), unless that replica is more than
  `balance_slack_rows` rows busier than the least-loaded one (`engine.routing`).
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
  stays up. With none left requests fail with `NoLiveReplicaError` (both are `EngineClosedError`s:
  HTTP 503).
- **Revival.** Given a `ReplicaFactory` (engine.revival) by whoever built the replicas, a dead
  replica is rebuilt on a thread of its own, with backoff, up to `ReviveConfig.max_attempts`
  times. The new engine rejoins only once nothing is paused (no step is training or being
  published) and with publishing held off: the factory catches it up to the served step
  (`catch_up`), the router loads every adapter published by name meanwhile, then it takes
  requests. A replica whose rebuilds all fail stays down, logged as an error. `stats()` counts
  `replicas_down`, `replica_restarts` and `replicas_lost`; `status()` shows each replica.

Replicas run where their engines run: TorchEngines in this process each decode on their own worker
thread (torch kernels release the GIL, the Python of the decoding loop does not), a `ProcessEngine`
(engine.torch.process_engine) in a child process of its own, a VLLMEngine in its own engine-core
process. Left out: building the replicas (`art_core.host.torch_replicas`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from art_core.engine.config import EngineStats, GenerationRequest
from art_core.engine.deltas import DeltaStream, RowDelta, token_stream
from art_core.engine.errors import (
    EngineClosedError,
    EngineOverloadedError,
    NoLiveReplicaError,
    ReplicaDownError,
)
from art_core.engine.protocol import Completion, Engine
from art_core.engine.revival import ReplicaFactory, ReviveConfig, close_quietly, revive
from art_core.engine.routing import Memory, RoutingConfig, block_hashes, least_loaded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the router sees it."""

    index: int
    """Its position in the replica list."""
    alive: bool
    """False while it is down (being rebuilt, or for good)."""
    in_flight_rows: int
    """Rows of its requests not yet answered (a request counts its `n`)."""
    requests: int
    """Requests sent to it so far (retries included)."""
    down_reason: str | None = None
    """Why it was last marked down (None while alive)."""
    reviving: bool = False
    """Whether it is down and being rebuilt (`ReplicaFactory`)."""
    restarts: int = 0
    """Times it was rebuilt after dying."""


@dataclass
class _Replica:
    engine: Engine
    alive: bool = True
    in_flight: int = 0
    requests: int = 0
    down_reason: str | None = None
    reviving: bool = False
    restarts: int = 0


def summed(a: EngineStats, b: EngineStats) -> EngineStats:
    """Two engines' counters added up (largest batch: the larger of the two)."""
    values = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(EngineStats)}
    values["max_batch_rows"] = max(a.max_batch_rows, b.max_batch_rows)
    return EngineStats(**values)


def _stats_of(engine: Engine) -> EngineStats:
    stats = getattr(engine, "stats", None)
    return stats() if stats is not None else EngineStats(0, 0, 0, 0)


class ReplicatedEngine:
    """N engines serving the same model, routed per request (see the module docstring).

    `factory`: rebuilds a replica that dies (None: it stays down); `revive`: how often and how soon.
    """

    def __init__(
        self,
        replicas: Sequence[Engine],
        routing: RoutingConfig | None = None,
        *,
        factory: ReplicaFactory | None = None,
        revive: ReviveConfig | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.routing = routing or RoutingConfig()
        self.factory = factory
        self.revive_config = revive or ReviveConfig()
        self._replicas = [_Replica(engine) for engine in replicas]
        self.max_context = min(int(r.max_context) for r in replicas)
        self._keys = Memory(self.routing.max_remembered)
        self._blocks = Memory(self.routing.max_remembered)
        self._rotation = 0
        self._lock = threading.Lock()  # routing state; taken inside `_control`, never around it
        self._control = threading.Condition(threading.RLock())  # publishing, pausing, rejoining
        self._paused = False
        self._published: dict[str, Path] = {}  # adapters loaded by name, replayed on a rebuilt replica
        self._stop = threading.Event()
        self._revivals: list[threading.Thread] = []
        self._retired = EngineStats(0, 0, 0, 0)  # counters of the engines that rebuilt ones replaced
        self._closed = False

    # -- routing ---------------------------------------------------------------------------

    @property
    def replicas(self) -> list[Engine]:
        """The engines, in order (down ones included; a rebuilt one replaces its predecessor)."""
        return [r.engine for r in self._replicas]

    def status(self) -> list[ReplicaStatus]:
        """Every replica's liveness, load and restarts."""
        with self._lock:
            return [
                ReplicaStatus(i, r.alive, r.in_flight, r.requests, r.down_reason, r.reviving, r.restarts)
                for i, r in enumerate(self._replicas)
            ]

    def live(self) -> list[int]:
        """Indices of the replicas not marked down."""
        with self._lock:
            return [i for i, r in enumerate(self._replicas) if r.alive]

    def mark_down(self, index: int, reason: str, engine: Engine | None = None) -> None:
        """Take replica `index` out of routing (its own requests fail or are retried); with a
        `factory` it is then rebuilt. Given `engine`, only if that is still replica `index`'s (a
        late report of an engine a rebuilt one replaced changes nothing)."""
        self._mark_down(index, self._replicas[index].engine if engine is None else engine, reason)

    def _mark_down(self, index: int, engine: Engine, reason: str) -> None:
        with self._lock:
            replica = self._replicas[index]
            if not replica.alive or replica.engine is not engine:
                return  # down already, or a late error of the engine a rebuilt one replaced
            reviving = self.factory is not None and self.revive_config.max_attempts > 0 and not self._closed
            replica.alive, replica.down_reason, replica.reviving = False, reason, reviving
            left = sum(r.alive for r in self._replicas)
        then = "rebuilding it" if reviving else "it stays down"
        logger.error("inference replica %d is down (%s); %d replica(s) left; %s", index, reason, left, then)
        if reviving:
            self._start_revival(index, engine)

    def _dispatch(self, request: GenerationRequest, exclude: set[int]) -> tuple[int, Engine]:
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
            return chosen, replica.engine

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

    def _died(self, index: int, engine: Engine, exc: BaseException) -> bool:
        """Whether `exc` from replica `index`'s `engine` means it is dead (then it is marked down)."""
        if not isinstance(exc, EngineClosedError) and not getattr(engine, "closed", False):
            return False
        if self._closed:
            return False
        self._mark_down(index, engine, f"{type(exc).__name__}: {exc}")
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
            index, engine = self._dispatch(request, tried)
            try:
                return await engine.generate(request)
            except Exception as exc:
                tried.add(index)
                if self._full(exc, tried):
                    continue
                if not self._died(index, engine, exc):
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
            index, engine = self._dispatch(request, tried)
            sent = False
            try:
                stream = token_stream(engine, request)
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
                if not self._died(index, engine, exc):
                    raise
                if sent:
                    raise ReplicaDownError(
                        f"inference replica {index} died while streaming this completion ({exc}); "
                        "the tokens sent so far are all there is: send the request again"
                    ) from exc
                logger.warning("retrying a stream of dead replica %d on another replica", index)
            finally:
                self._done(index, request)

    # -- revival (with a factory) ------------------------------------------------------------

    def _start_revival(self, index: int, dead: Engine) -> None:
        thread = threading.Thread(
            target=self._revive, args=(index, dead), name=f"art-replica-{index}-revival", daemon=True
        )
        with self._lock:
            self._revivals = [t for t in self._revivals if t.is_alive()] + [thread]
        thread.start()

    def _revive(self, index: int, dead: Engine) -> None:
        """The revival thread: close the dead engine, then rebuild until one rejoins or attempts run out."""
        factory = self.factory
        assert factory is not None  # only started with one
        close_quietly(dead)
        back = revive(
            index, factory, self.revive_config, self._stop, lambda e: self._rejoin(index, e, factory)
        )
        if not back:
            with self._lock:
                self._replicas[index].reviving = False

    def _rejoin(self, index: int, engine: Engine, factory: ReplicaFactory) -> None:
        """Catch `engine` up and put it in replica `index`'s place, once nothing is paused and with
        publishing held off, so that it serves the current step and no publish passes it by."""
        with self._control:
            while self._paused and not self._stop.is_set():
                self._control.wait()
            if self._stop.is_set():
                raise NoLiveReplicaError("the replicated engine was closed")
            factory.catch_up(index, engine)
            for name, path in self._published.items():
                if name not in engine.adapters():
                    engine.add_adapter(name, path)
            with self._lock:
                if self._closed:
                    raise NoLiveReplicaError("the replicated engine was closed")
                replica = self._replicas[index]
                self._retired = summed(self._retired, _stats_of(replica.engine))
                replica.engine, replica.alive, replica.reviving = engine, True, False
                replica.down_reason, replica.restarts = None, replica.restarts + 1

    # -- adapters and lifecycle: every live replica ------------------------------------------

    def _each(self, what: str, call: Callable[[Engine], Any]) -> list[Any]:
        """`call(engine)` on every live replica, in order; replicas that turn out dead are marked
        down. Whatever changes the replicas (publishing, pausing) calls it holding `_control`."""
        results = []
        for index in self.live():
            engine = self._replicas[index].engine
            if getattr(engine, "closed", False) and not self._closed:
                self._mark_down(index, engine, "its engine is closed")
                continue
            try:
                results.append(call(engine))
            except Exception as exc:
                if not self._died(index, engine, exc):
                    raise
        with self._lock:
            if not any(r.alive or r.reviving for r in self._replicas):
                raise NoLiveReplicaError(f"no inference replica is left to {what}")
        return results

    def add_adapter(self, name: str, path: Path) -> None:
        """Load adapter `name` on every live replica; returns once all have it (a rebuilt replica
        loads it before it rejoins)."""
        with self._control:
            self._each(f"load adapter {name!r}", lambda e: e.add_adapter(name, path))
            self._published[name] = Path(path)

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name` from every live replica."""
        with self._control:
            self._each(f"remove adapter {name!r}", lambda e: e.remove_adapter(name))
            self._published.pop(name, None)

    def adapters(self) -> list[str]:
        """The adapters every live replica has loaded ([] while none is live)."""
        names = self._each("list adapters", lambda e: e.adapters())
        if not names:
            return []
        common = set.intersection(*(set(n) for n in names))
        return [n for n in names[0] if n in common]

    def pause(self) -> None:
        """Pause every live replica (each waits for its running batch); no rebuilt one rejoins until `resume()`."""
        with self._control:
            self._paused = True
            self._each("pause", lambda e: e.pause())

    def resume(self) -> None:
        """Resume every live replica."""
        with self._control:
            try:
                self._each("resume", lambda e: e.resume())
            finally:
                self._paused = False
                self._control.notify_all()

    def stats(self) -> EngineStats:
        """The replicas' counters summed, those of replaced engines included (largest batch: the
        largest of any), with the router's: replicas down now, restarts, replicas down for good."""
        total = self._retired
        for engine in self.replicas:
            total = summed(total, _stats_of(engine))
        with self._lock:
            down = sum(not r.alive for r in self._replicas)
            lost = sum(not r.alive and not r.reviving for r in self._replicas)
            restarts = sum(r.restarts for r in self._replicas)
        return replace(total, replicas_down=down, replica_restarts=restarts, replicas_lost=lost)

    def close(self) -> None:
        """Close every replica (down ones too) and stop rebuilding; later requests fail with NoLiveReplicaError."""
        with self._lock:
            self._closed = True
            revivals = list(self._revivals)
        self._stop.set()
        with self._control:
            self._control.notify_all()
        for thread in revivals:
            thread.join(timeout=30)
            if thread.is_alive():
                logger.warning("%s is still building a replica; it closes the replica when done", thread.name)
        for engine in self.replicas:
            close_quietly(engine)


__all__ = [
    "NoLiveReplicaError",
    "ReplicaDownError",
    "ReplicaStatus",
    "ReplicatedEngine",
    "RoutingConfig",
    "block_hashes",
    "least_loaded",
    "summed",
]
