"""`Engine`: the interface the server and the trainer use, implemented by `TorchEngine`
(`art_core.engine.torch.engine`) and `VLLMEngine` (`art_core.engine.vllm.engine`).

Re-exported by `art_core.engine.torch.engine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from art_core.engine.config import GenerationRequest
from art_core.engine.torch.decoding import Completion


class Engine(Protocol):
    """What the server and the trainer need from an inference engine."""

    async def generate(self, request: GenerationRequest) -> list[Completion]: ...
    def add_adapter(self, name: str, path: Path) -> None: ...
    def remove_adapter(self, name: str) -> None: ...
    def adapters(self) -> list[str]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...
