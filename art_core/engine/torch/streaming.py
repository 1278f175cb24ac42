"""Token streaming out of an engine: each row's tokens as they are sampled, handed to the caller's loop.

`TorchEngine.generate_stream(request)` returns a `TokenStream`, an async iterator of increments:
lists of `RowDelta`, one per row that sampled tokens since the previous increment. A row's deltas
concatenate to its completion's `token_ids`, `logprobs` and `top_logprobs`; its last delta carries
the finished `Completion`, sent as soon as that row ends. The worker calls `DeltaChannel.push` per
token; the first token of a burst schedules one `call_soon_threadsafe` flush, so a decode step
costs the loop one callback per request. `TokenStream.aclose()` cancels the request (its rows end
at their next token, finish reason ABORT). Left out: the contract the server reads (`RowDelta`,
`DeltaStream`, `token_stream` for engines that cannot stream: `art_core.engine.deltas`) and text
(deltas carry ids; the server decodes them with `art_core.engine.detokenizer`). See
docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from art_core.engine.deltas import RowDelta
from art_core.engine.protocol import Completion
from art_core.engine.torch.decoding import RowState


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


__all__ = ["DeltaChannel", "TokenStream"]
