"""What an inference engine is to the server and the host: the `Engine` protocol and its `Completion`.

`Engine` is implemented by `TorchEngine` (`art_core.engine.torch.engine`) and `VLLMEngine`
(`art_core.engine.vllm.engine`), and over several of them by `ReplicatedEngine`
(`art_core.engine.replicas`); `Completion` is what they return for each sampled row. Plain
data and a protocol, no torch: the server (`art_core.server`) reaches engines only through here,
`engine.config` and `engine.errors`. Left out: streaming (`engine.deltas`, `engine.torch.streaming`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from art_core.engine.config import GenerationRequest
from art_core.engine.finish_reason import FinishReason


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """Sampled ids, including the final eos/stop token if one was sampled."""
    logprobs: list[float]
    """Raw log-softmax (temperature 1, before top-p) of each sampled id under the serving policy:
    what the trainer's importance correction compares against (fp32: equal to ~1e-5)."""
    top_logprobs: list[list[tuple[int, float]]]
    """Per sampled position, the `params.top_logprobs` most likely (id, logprob) pairs (empty lists if 0)."""
    text: str
    """Decoded completion, without the final eos/stop token and without the stop string (if hit)."""
    finish_reason: FinishReason
    """STOP (eos, a stop id or a stop string), LENGTH (max_tokens or the context window) or ABORT
    (its request was cancelled mid-decoding; nobody receives it)."""


class Engine(Protocol):
    """What the server and the trainer need from an inference engine."""

    max_context: int
    """Prompt + completion token limit of what it serves (the one owner of that number)."""

    async def generate(self, request: GenerationRequest) -> list[Completion]: ...
    def add_adapter(self, name: str, path: Path) -> None: ...
    def remove_adapter(self, name: str) -> None: ...
    def adapters(self) -> list[str]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...
