"""The torch inference engine: `TorchEngine`, batched generation with per-row LoRA adapters.

This module is intake and lifecycle: `generate` and `generate_stream` check, admit
(`art_core.engine.admission`) and queue a request's rows through one path; one worker thread does
all torch compute, runs adapter operations between batches, keeps the merged serving copy fresh
(`serving_weights`) and runs each batch's lanes (`decoding.DecodeBatch`), answering each request
as its last row ends; `pause`/`resume`/`close` hand the model to a trainer and back. What starts a
batch, what joins one and when is decided by `scheduler.Scheduler`, as data; adapter loading is
`adapters.Adapters`. Left out: the decoding loop and the KV cache (`decoding`, `kv_cache`,
`prefix_cache`, `decode_step`) and token streaming (`streaming`). The design, the staleness
contract of the serving copy and the measurements are in docs/architecture.md ("The torch
engine") and docs/benchmarks.md. The engine's records (`EngineConfig`, `GenerationRequest`,
`EngineStats`) live in `engine.config`, the `Engine` protocol and `Completion` in `engine.protocol`
and its errors in `engine.errors`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from art_core.engine.admission import Admission, RateWindow
from art_core.engine.config import EngineConfig, EngineStats, GenerationRequest
from art_core.engine.errors import (
    ContextLengthError,
    EngineClosedError,
    InvalidRequestError,
    UnknownAdapterError,
)
from art_core.engine.finish_reason import FinishReason
from art_core.engine.grammar import RowConstraint
from art_core.engine.openmp import SPINS, release_thread_pool, wait_policy
from art_core.engine.protocol import Completion
from art_core.engine.sampling import row_seed
from art_core.engine.torch.adapters import Adapters, modes_kept
from art_core.engine.torch.decoding import DecodeBatch, RowState
from art_core.engine.torch.lora_serving import UnmergedWeights
from art_core.engine.torch.prefix_cache import PrefixCache
from art_core.engine.torch.scheduler import Gate, Lane, LanePlan, Scheduler, Serving
from art_core.engine.torch.serving_copy import serving_copy
from art_core.engine.torch.serving_weights import UnsupportedAdapterError, peft_model_of
from art_core.engine.torch.streaming import DeltaChannel, TokenStream
from art_core.engine.torch.threads import ThreadTuner, apply

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Completion]]
    results: list[Completion | None]
    remaining: int
    done: bool = False
    channel: DeltaChannel | None = None
    """Where the rows' tokens stream to (`generate_stream`); None for `generate`."""
    released: bool = False
    """Its rows no longer count against `max_queued_rows` (`TorchEngine._release`)."""

    def on_token(self, row: RowState) -> bool:
        """`RowState.on_token` (worker thread): stream the token; False once nobody waits for the rows."""
        if self.done:
            return False
        if self.channel is not None:
            self.channel.push(row)
        return True

    def resolve(self, value: list[Completion] | BaseException) -> None:
        if self.done:
            return
        self.done = True
        if self.channel is not None:
            self.channel.finish(value)
            return
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, value)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


def _settle(future: asyncio.Future[list[Completion]], value: list[Completion] | BaseException) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


class TorchEngine:
    """Batched generation on a transformers model (optionally a peft `PeftModel` with LoRA adapters).

    Sharing the model with a trainer in the same process: call `pause()` before training and
    `resume()` after. `pause()` waits for the running batch (and adapter loads) to finish and
    keeps the worker from starting another; requests that arrive meanwhile wait in the queue (none
    is rejected or lost). While paused the model belongs to the caller: `add_adapter` and
    `remove_adapter` then run at once in the calling thread (e.g. the trainer loading the
    checkpoint it just saved); otherwise they run on the worker between batches. The engine never
    changes the trainer's state: each batch runs under `torch.inference_mode` in the worker
    thread; rows of the served adapter run on the separate serving copy (`resume()` re-merges
    it); other rows run on the model itself, in eval mode (every module's training flag is
    restored afterwards), selecting adapters per row through peft's `adapter_names` (base rows
    use "__base__"), so the active adapter and `requires_grad` flags are untouched.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self._adapters = Adapters(model)
        self._tokenizer = tokenizer
        self.config = config
        self.max_context = config.max_context or int(model.config.max_position_embeddings)
        self._eos_ids = _eos_ids(model, tokenizer) if config.stop_on_eos else frozenset()
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._rng = torch.Generator()
        self._rng.seed()
        self._scheduler = Scheduler(config.max_batch_size, config.batch_wait_s, config.batch_wait_max_s)
        self._cond = threading.Condition()
        self._rows: deque[RowState] = deque()
        self._ops: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._paused = self._busy = self._closed = False
        self._arrived = 0.0  # when rows were last queued (monotonic): a batch waits for a burst
        self._death: BaseException | None = None
        self._stats = EngineStats(0, 0, 0, 0)
        self._admission = Admission(config.max_queued_rows)  # counted and released holding _cond
        self._serving = (
            serving_copy(
                model,
                config.serve_adapter,
                config.serve_dtype,
                pack=config.pack_weights,
                unmerged=config.serve_unmerged,
            )
            if config.merged_serving
            else None
        )
        mib = config.prefix_cache_mib
        self._prefix = PrefixCache(mib * 2**20) if mib and self._serving is not None else None
        self._resync = False  # a full re-merge of the serving copy is due (set by resume, weights_updated)
        self._rebase = False  # ...and its base weights may have been written too (weights_updated)
        self._threads = ThreadTuner.for_machine() if config.adapt_threads else None
        if torch.get_num_threads() > 1 and wait_policy() == "DEFAULT":
            logger.info(
                "OpenMP threads spin long at barriers (neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT set): "
                "on shared cores set GOMP_SPINCOUNT=%d before starting Python (the `art` CLI does); "
                "see docs/benchmarks.md",
                SPINS,
            )
        release_thread_pool()  # this thread's OpenMP workers would throttle the decode thread's
        self._thread = threading.Thread(target=self._work, name="art-engine", daemon=True)
        self._thread.start()

    @property
    def model(self) -> Any:
        """The model the engine runs (a `PeftModel` once adapters were added to a plain model)."""
        return self._adapters.model

    @property
    def serving_model(self) -> Any | None:
        """The serving copy's plain model, merged or unmerged (None without one), for inspection and benchmarks."""
        return self._serving.model if self._serving is not None else None

    @property
    def serves_unmerged(self) -> bool:
        """Whether the serving copy is the unmerged one (`lora_serving`: the trainer's base weights
        plus the LoRA update) rather than a merged copy."""
        return isinstance(self._serving, UnmergedWeights)

    @property
    def served_adapter(self) -> str | None:
        """The adapter whose rows decode on the serving copy (None: the base model, or no copy)."""
        return self._serving.adapter if self._serving is not None else None

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """Sample `request.params.n` completions.

        Raises InvalidRequestError (ContextLengthError; n above `max_queued_rows`),
        UnknownAdapterError, EngineOverloadedError (the engine is full: retry later) and
        EngineClosedError.
        """
        job = self._enqueue(request, None)  # counted until this call returns, however it ends
        try:
            return await job.future
        except asyncio.CancelledError:
            job.done = True  # its queued rows are skipped
            raise
        finally:
            self._release(job)

    def generate_stream(self, request: GenerationRequest) -> TokenStream:
        """`generate`, streamed: each row's tokens as they are sampled (see `art_core.engine.torch.streaming`).

        Call it on the event loop that iterates the stream. Raises at once what `generate` raises
        before queueing (InvalidRequestError, UnknownAdapterError, EngineOverloadedError,
        EngineClosedError); a failure while decoding comes out of the iteration. The rows count
        against `max_queued_rows` until the stream ends or is closed; closing it early cancels them.
        """
        channel = DeltaChannel(asyncio.get_running_loop(), self._tokenizer)
        job = self._enqueue(request, channel)

        def cancel() -> None:  # once (TokenStream.close): the stream ended, or its consumer left early
            job.done = True  # queued rows are skipped, decoding rows end at their next token
            self._release(job)

        return TokenStream(channel, cancel)

    def _enqueue(self, request: GenerationRequest, channel: DeltaChannel | None) -> _Job:
        """Check and admit `request`, then queue its rows; they count until `_release(job)` (done
        here already if this raises)."""
        self._check_request(request)
        loop = asyncio.get_running_loop()
        n = request.params.n
        self._admit(n)
        job = _Job(request, loop, loop.create_future(), [None] * n, n, channel=channel)
        try:
            max_new = min(request.params.max_tokens, self.max_context - len(request.prompt_ids))
            rows = [self._row(job, i, max_new) for i in range(n)]  # a grammar may fail to start
            with self._cond:
                if self._closed:
                    raise EngineClosedError("the engine is closed") from self._death
                self._rows.extend(rows)
                self._arrived = time.monotonic()
                self._cond.notify_all()
        except BaseException:
            self._release(job)
            raise
        return job

    def _release(self, job: _Job) -> None:
        """Stop counting the job's rows against `max_queued_rows` (idempotent)."""
        with self._cond:
            if not job.released:
                job.released = True
                self._admission.release(job.request.params.n)

    @property
    def closed(self) -> bool:
        """Whether the engine was closed or its worker died (it then serves nothing more)."""
        return self._closed

    def pending_rows(self) -> int:
        """Rows admitted and not yet answered: queued, decoding, or waiting out a pause."""
        with self._cond:
            return self._admission.rows

    def _admit(self, n: int) -> None:
        """Count `n` rows against `max_queued_rows`; EngineOverloadedError if they do not fit."""
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed") from self._death
            self._admission.admit(n)

    def _check_request(self, request: GenerationRequest) -> None:
        if request.params.n > self.config.max_queued_rows:
            raise InvalidRequestError(
                f"n={request.params.n} is more than this engine ever admits at once "
                f"(EngineConfig.max_queued_rows={self.config.max_queued_rows}); ask for fewer completions "
                "per request"
            )
        n_prompt = len(request.prompt_ids)
        if n_prompt == 0:
            raise InvalidRequestError("prompt_ids is empty: the engine needs at least one prompt token")
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self._vocab_size:
            raise InvalidRequestError(
                f"prompt_ids must be token ids in [0, {self._vocab_size}); got one outside"
            )
        if n_prompt > self.max_context - 1:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens but the context window is {self.max_context} tokens "
                f"(prompt + completion); shorten the prompt to at most {self.max_context - 1} tokens"
            )
        if request.adapter is not None and request.adapter not in self.adapters():
            raise UnknownAdapterError(
                f"adapter {request.adapter!r} is not loaded; loaded: {self.adapters()} (call add_adapter first)"
            )

    def _row(self, job: _Job, index: int, max_new: int) -> RowState:
        params = job.request.params
        generator = self._rng
        if params.seed is not None:
            generator = torch.Generator().manual_seed(row_seed(params.seed, index))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        grammar = job.request.grammar
        constraint = None if grammar is None else RowConstraint(grammar, self._tokenizer, self._vocab_size)
        return RowState(
            job,
            index,
            job.request.prompt_ids,
            params,
            job.request.adapter,
            max_new,
            generator,
            stop_ids,
            constraint=constraint,
            on_token=job.on_token,
        )

    # -- adapters ----------------------------------------------------------------------------

    def adapters(self) -> list[str]:
        """Names of the loaded peft adapters (including a trainer's own), [] for a plain model."""
        return self._adapters.names()

    def add_adapter(self, name: str, path: Path | str) -> None:
        """Load the peft adapter saved in folder `path` under `name` (never races a batch)."""
        self._control(lambda: self._adapters.load(name, Path(path)))

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name` (one `add_adapter` loaded); queued requests for it then fail."""
        self._control(lambda: self._adapters.delete(name))

    def _control(self, op: Callable[[], T]) -> T:
        """Run `op` between batches on the worker, or at once in this thread while paused."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            while self._paused and self._busy:
                self._cond.wait()
            if self._closed:
                raise EngineClosedError("the engine is closed") from self._death
            direct = self._paused
            if not direct:
                self._ops.append((op, future))
                self._cond.notify_all()
        return op() if direct else future.result()

    # -- pause / resume / close ------------------------------------------------------------

    def pause(self) -> None:
        """Wait for the running batch to finish and start no other until `resume()` (idempotent)."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()

    def resume(self, *, rewritten: bool = True) -> None:
        """Re-merge the serving copy, then let the worker run batches again (no-op if not paused).

        The re-merge (~0.15 s for SmolLM2 on 2 AVX2 cores) runs here, on the calling thread (the
        trainer's, typically), while the engine is still paused: in the quiet moment after a train
        step, before the step's checkpoint write and the next requests' handling compete with it
        for the CPUs (on the worker, as those began, the demo's re-merge took 0.35 s for a 0.14 s
        merge). Other control calls wait meanwhile. `rewritten` False: the caller wrote no weights
        while paused (a train step that took no optimizer step), so nothing is re-merged; a write
        through torch would still be seen by its version counters, as between batches. The calling
        thread then hands the CPUs back: its OpenMP workers end
        (`art_core.engine.openmp.release_thread_pool`).
        """
        with self._cond:
            while self._paused and self._busy:  # another resume merging
                self._cond.wait()
            merge = self._paused and rewritten and self._serving is not None and not self._closed
            if merge:
                self._busy = True  # control calls wait (`_control`), as for a batch
                rebase, self._resync, self._rebase = self._rebase, False, False
        try:
            if merge:
                self._sync_serving(force=True, rebase=rebase)
        finally:
            release_thread_pool()
            with self._cond:
                if merge:
                    self._busy = False
                self._paused = False
                self._cond.notify_all()

    def weights_updated(self) -> None:
        """Re-merge the serving copy from the model's current weights before the next batch.

        Not needed after `pause()`/`resume()` (which re-merge) nor after in-place writes through
        torch (detected by version counters); for writes that bypass them, made while not paused.
        """
        with self._cond:
            self._resync = self._rebase = self._serving is not None
            self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """`with engine.paused(): train()`."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        """Stop the worker after its running batch; queued requests fail with EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        self._fail_queued(EngineClosedError("the engine was closed before this request ran"))

    def stats(self) -> EngineStats:
        """Counters: batches, rows, tokens, largest batch, serving-copy merges, prefix-cache hits."""
        stats, serving, prefix = self._stats, self._serving, self._prefix
        if serving is not None:
            stats = replace(stats, merges=serving.merges, merge_seconds=serving.merge_seconds)
        if prefix is not None:
            counts = prefix.stats()
            stats = replace(
                stats, prompt_tokens=counts.looked_up_tokens, cached_prompt_tokens=counts.hit_tokens
            )
        return stats

    # -- worker ------------------------------------------------------------------------------

    def _idle(self) -> bool:
        """With the lock held: whether the worker has nothing it may run now (not closed, and paused
        or without rows, ops or a due re-merge)."""
        return not self._closed and (self._paused or not (self._rows or self._ops or self._resync))

    def _gate(self) -> Gate:
        """With the lock held: what holds the worker back."""
        return Gate(self._paused, self._closed, bool(self._ops), self._resync)

    def _work(self) -> None:
        if self._threads is not None:  # the thread count is per thread in OpenMP: set it here
            apply(self._threads.current)
        pool = False  # whether this thread ran torch work since its OpenMP workers were last let go
        try:
            while True:
                with self._cond:
                    idle = self._idle()
                if idle and pool:
                    # Paused (the trainer runs) or nothing to do: this thread's OpenMP workers would
                    # cut every other thread's barrier spins meanwhile (`art_core.engine.openmp`;
                    # the demo's train step ~15% slower beside them). The next op starts new ones.
                    release_thread_pool()
                    pool = False
                with self._cond:
                    while self._idle():
                        self._cond.wait()
                    since = time.monotonic()
                    while True:  # the requests of a burst join the first one's batch
                        plan = self._scheduler.plan(
                            self._rows,
                            None,
                            gate=self._gate(),
                            now=time.monotonic(),
                            arrived=self._arrived,
                            since=since,
                        )
                        if plan.wait_s <= 0:
                            break
                        self._cond.wait(plan.wait_s)
                    if self._closed:
                        return
                    if self._paused:
                        continue
                    ops, self._ops = list(self._ops), deque()
                    if plan.queue is not None:
                        self._rows = deque(plan.queue)
                    force, self._resync = self._resync, False
                    rebase, self._rebase = self._rebase, False
                    self._busy = True
                pool = True
                try:
                    for op, future in ops:
                        _run_op(op, future)
                    self._sync_serving(force, rebase)
                    if plan.start:
                        self._run_batch(list(plan.start))
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as exc:  # a bug in the loop itself: fail everyone rather than hang
            logger.exception("engine worker died")
            self._death = exc
            with self._cond:
                self._closed = True
            self._fail_queued(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        with self._cond:
            rows, self._rows = list(self._rows), deque()
            ops, self._ops = list(self._ops), deque()
        for row in rows:
            row.job.resolve(exc)
        for _, future in ops:
            future.set_exception(exc)

    def _sync_serving(self, force: bool, rebase: bool = False) -> None:
        """Bring the serving copy up to date (changed tensors only, or all if `force`; `rebase`: the
        base weights too, where the copy serves them as they are); on the worker."""
        if self._serving is None:
            return
        try:
            self._serving.sync(self.model, force=force, base=rebase)
        except Exception as exc:  # e.g. the served adapter was deleted; a half-written copy is never used
            level = logging.WARNING if isinstance(exc, UnsupportedAdapterError) else logging.ERROR
            logger.log(level, "dropped the merged serving copy (its rows now run through peft): %s", exc)
            self._serving = None

    def _serving_view(self, stale: bool = False) -> Serving | None:
        return None if self._serving is None else Serving(self._serving.adapter, stale)

    def _runnable(self, rows: list[RowState]) -> list[RowState]:
        """`rows` without cancelled ones; rows of adapters removed meanwhile fail with UnknownAdapterError."""
        loaded = set(self.adapters())
        for row in rows:
            if row.adapter is not None and row.adapter not in loaded:
                row.job.resolve(
                    UnknownAdapterError(f"adapter {row.adapter!r} was removed before the request ran")
                )
        return [r for r in rows if not r.job.done]

    def _run_batch(self, rows: list[RowState]) -> None:
        """Decode `rows` in one or two lanes (serving copy, peft model); more rows join while they run."""
        rows = self._runnable(rows)
        if not rows:
            return
        logger.debug("engine batch: %d rows from %d requests", len(rows), len({id(r.job) for r in rows}))
        self._stats = replace(self._stats, batches=self._stats.batches + 1)
        serving = self._serving
        with torch.inference_mode():
            for lane in self._scheduler.lanes(rows, self._serving_view()):
                if lane.lane is Lane.SERVING and serving is not None:
                    self._run_lane(lane, serving.model, peft=False)
                elif lane.lane is Lane.PEFT:
                    with modes_kept(self.model, eval_inside=True):
                        self._run_lane(lane, self.model, peft_model_of(self.model))

    def _run_lane(self, plan: LanePlan[RowState], model: Any, peft: bool) -> None:
        """One DecodeBatch on `model`; queued rows of the same lane join it while it runs (if joinable)."""
        lane = _LaneRun(list(plan.rows))

        def admit(room: int) -> list[RowState]:
            joiners = self._take_joiners(room, plan.lane) if plan.joinable else []
            if joiners:
                lane.joined(joiners)
                s = self._stats
                self._stats = replace(
                    s,
                    max_batch_rows=max(s.max_batch_rows, lane.live),
                    joins=s.joins + 1,
                    joined_rows=s.joined_rows + len(joiners),
                )
            return joiners

        def finished(done: list[RowState]) -> None:
            lane.finished(done)
            self._finish(done)
            if lane.rate.seconds() >= 1.0:
                self._admission.note_rate(*lane.rate.take())

        self._stats = replace(self._stats, max_batch_rows=max(self._stats.max_batch_rows, lane.live))
        prefix = self._prefix_cache() if plan.prefix_cache else None
        try:
            DecodeBatch(model, self._tokenizer, list(plan.rows), peft, prefix).run(
                self.config.prune_fraction,
                admit=admit,
                finished=finished,
                max_rows=self.config.max_batch_size,
                threads=self._threads,
            )
        except Exception as exc:  # every request of the lane gets the error; the worker carries on
            logger.exception("engine batch of %d rows failed", len(lane.unfinished))
            for row in lane.unfinished:
                row.job.resolve(exc)
        if lane.rate.seconds() > 0 and lane.rate.finished:
            self._admission.note_rate(*lane.rate.take())

    def _prefix_cache(self) -> PrefixCache | None:
        """The serving copy's prefix cache, valid for its current merge (`merges` counts them)."""
        serving = self._serving
        if serving is None or self._prefix is None:
            return None
        return self._prefix.for_weights((id(serving), serving.merges))

    def _take_joiners(self, room: int, lane: Lane) -> list[RowState]:
        """Up to `room` queued rows to join the running `lane`, as the scheduler plans them."""
        if not self._rows:
            return []
        serving = self._serving
        stale = lane is Lane.SERVING and serving is not None and serving.stale(self.model)
        with self._cond:
            plan = self._scheduler.plan(
                self._rows, lane, gate=self._gate(), serving=self._serving_view(stale), room=room
            )
            if plan.queue is not None:
                self._rows = deque(plan.queue)
        return self._runnable(list(plan.join)) if plan.join else []

    def _finish(self, rows: list[RowState]) -> None:
        """Hand finished rows to their requests (a request resolves when its last row finishes)."""
        s = self._stats
        self._stats = replace(
            s,
            rows=s.rows + len(rows),
            tokens=s.tokens + sum(len(r.token_ids) for r in rows),
            aborted=s.aborted + sum(r.finish_reason is FinishReason.ABORT for r in rows),
        )
        for row in rows:
            job = row.job
            job.results[row.index] = row.completion(self._tokenizer)
            job.remaining -= 1
            if job.remaining == 0:
                job.resolve([c for c in job.results if c is not None])


class _LaneRun:
    """Which rows of a running DecodeBatch have not finished yet (to fail them if it breaks)."""

    def __init__(self, rows: list[RowState]) -> None:
        self._unfinished = {id(r): r for r in rows}
        self.rate = RateWindow()
        """Rows finished over decoding time (the rate behind Retry-After, `art_core.engine.admission`)."""

    @property
    def live(self) -> int:
        return len(self._unfinished)

    @property
    def unfinished(self) -> list[RowState]:
        return list(self._unfinished.values())

    def joined(self, rows: list[RowState]) -> None:
        self._unfinished.update((id(r), r) for r in rows)

    def finished(self, rows: list[RowState]) -> None:
        self.rate.count(len(rows))
        for row in rows:
            self._unfinished.pop(id(row), None)


def _run_op(op: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
    try:
        future.set_result(op())
    except Exception as exc:
        future.set_exception(exc)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids: from its generation config and its tokenizer."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
