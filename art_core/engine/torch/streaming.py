"""Token streaming out of an engine: each row's tokens as they are sampled, handed to the caller's loop.

`TorchEngine.generate_stream(request)` returns a `TokenStream`, an async iterator of increments:
lists of `RowDelta`, one per row that sampled tokens since the previous increment. A row's deltas
concatenate to its completion's `token_ids`, `logprobs` and `top_logprobs`; its last delta carries
the finished `Completion`, sent as soon as that row ends. The worker calls `DeltaChannel.push` per
token; the first token of a burst schedules one `call_soon_threadsafe` flush, so a decode step
costs the loop one callback per request. `TokenStream.aclose()` cancels the request (its rows end
at their next token, finish reason ABORT). `token_stream(engine, request)` serves engines without
`generate_stream` (`VLLMEngine`) as one whole increment. Left out: text (deltas carry ids; the
server decodes them with `art_core.engine.detokenizer`). See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from art_core.engine.protocol import Completion
from art_core.engine.torch.decoding import RowState

if TYPE_CHECKING:
    from art_core.engine.config import GenerationRequest
    from art_core.engine.protocol import Engine


@dataclass(frozen=True)
class RowDelta:
    """What one row of a request sampled since its previous delta."""

    index: int
    """The row: completion `index` of the request (the choice index)."""
    token_ids: list[int]
    """The new sampled ids (the final eos/stop id included, as in `Completion.token_ids`)."""
    logprobs: list[float]
    """Their log-probs, aligned with `token_ids`."""
    top_logprobs: list[list[tuple[int, float]]]
    """Their top alternatives, aligned with `token_ids` (empty lists if none were asked for)."""
    completion: Completion | None = None
    """The finished completion, on the row's last delta only."""


class DeltaStream(Protocol):
    """What the server reads: increments until the request is done; `aclose()` cancels it."""

    def __aiter__(self) -> AsyncIterator[list[RowDelta]]: ...
    def __anext__(self) -> Awaitable[list[RowDelta]]: ...
    def aclose(self) -> Awaitable[None]: ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that streams tokens (see `TorchEngine.generate_stream`)."""

    def generate_stream(self, request: GenerationRequest) -> DeltaStream: ...


@dataclass
class _Pending:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    completion: Completion | None = None


_END = object()


class DeltaChannel:
    """One streaming request's tokens, from the engine's worker thread to the caller's event loop.

    `push` and `finish` run on the worker; the queue is touched only on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> None:
        self._loop = loop
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._scheduled = False
        self.queue: asyncio.Queue[list[RowDelta] | BaseException | object] = asyncio.Queue()

    def push(self, row: RowState) -> None:
        """Worker: the token `row` just recorded (and its completion, if that token ended it)."""
        completion = row.completion(self._tokenizer) if row.finish_reason is not None else None
        with self._lock:
            pending = self._pending.setdefault(row.index, _Pending())
            pending.token_ids.append(row.token_ids[-1])
            pending.logprobs.append(row.logprobs[-1])
            pending.top.append(row.top[-1])
            pending.completion = completion
            if self._scheduled:
                return
            self._scheduled = True
        self._call(self._flush)

    def finish(self, value: object) -> None:
        """Worker: the request is over (`value`: its completions, or the exception that ended it)."""
        self._call(self._close, value)

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, {}, False
        if pending:
            self.queue.put_nowait(
                [
                    RowDelta(index, p.token_ids, p.logprobs, p.top, p.completion)
                    for index, p in sorted(pending.items())
                ]
            )

    def _close(self, value: object) -> None:
        self._flush()
        self.queue.put_nowait(value if isinstance(value, BaseException) else _END)


class TokenStream:
    """The increments of one request (see the module docstring); `aclose()` cancels what is left.

    Iterate it on the event loop that called `generate_stream`.
    """

    def __init__(self, channel: DeltaChannel, cancel: Callable[[], None]) -> None:
        self._channel = channel
        self._cancel: Callable[[], None] | None = cancel
        self._ended = False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> list[RowDelta]:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._channel.queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        if isinstance(item, list):
            return item
        self.close()
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration

    def close(self) -> None:
        """End the stream; if the request still runs, its rows stop at their next token. Idempotent."""
        self._ended = True
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()

    async def aclose(self) -> None:
        self.close()


def token_stream(engine: Engine, request: GenerationRequest) -> DeltaStream:
    """`engine.generate_stream(request)`; for an engine that cannot stream, its whole completions at once.

    An error that refuses the request (bad request, full engine) raises at this call or at the first
    `__anext__` (engines without streaming); errors while generating come out of the iteration.
    """
    if isinstance(engine, StreamingEngine):
        return engine.generate_stream(request)
    return _whole_completions(engine, request)


async def _whole_completions(
    engine: Engine, request: GenerationRequest
) -> AsyncGenerator[list[RowDelta], None]:
    completions = await engine.generate(request)
    yield [RowDelta(i, c.token_ids, c.logprobs, c.top_logprobs, c) for i, c in enumerate(completions)]


__all__ = ["DeltaChannel", "DeltaStream", "RowDelta", "StreamingEngine", "TokenStream", "token_stream"]
