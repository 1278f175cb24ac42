"""`Engine`: the interface the server and the trainer use, implemented by `TorchEngine`
(`art_core.engine`) and `VLLMEngine` (`art_core.vllm_engine`).

Re-exported by `art_core.engine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from art_core.decoding import Completion
from art_core.engine_config import GenerationRequest


class Engine(Protocol):
    """What the server and the trainer need from an inference engine."""

    async def generate(self, request: GenerationRequest) -> list[Completion]: ...
    def add_adapter(self, name: str, path: Path) -> None: ...
    def remove_adapter(self, name: str) -> None: ...
    def adapters(self) -> list[str]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...
