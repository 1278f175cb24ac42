"""The streaming contract between an engine and the server, engine-neutral: `RowDelta` (what one row
sampled since its previous increment), `DeltaStream` (what the server iterates; `aclose()`
cancels), `StreamingEngine` (an engine with `generate_stream`) and `token_stream(engine, request)`,
which streams where the engine can and otherwise yields its whole completions as one increment
(`VLLMEngine`). Left out: how the torch engine produces increments (`engine.torch.streaming`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from art_core.engine.protocol import Completion

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


__all__ = ["DeltaStream", "RowDelta", "StreamingEngine", "token_stream"]
