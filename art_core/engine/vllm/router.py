"""Which vLLM adapter serves `name` and `name@step` while the trainer checkpoints step after step.

TorchEngine trains and serves one peft model, so `name` is simply its live adapter. vLLM holds
its own copy of the weights in its own process: every step's checkpoint has to be hot-loaded into
it. `VLLMAdapterRouter` does that bookkeeping for `ModelService` (engine="vllm").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_core.engine.errors import UnknownAdapterError
from art_core.storage import InvalidServedNameError, parse_served_name, served_name


class VLLMAdapterRouter:
    """Hot-loads each step's checkpoint into an engine and maps served names to its adapters.

    - `publish(step, dir)` loads the checkpoint under the plain name `model`, replacing the
      previous step's adapter of that name. The engine looks an adapter name up when it admits a
      request, not when the request arrives, so `model` always means the newest published weights:
      requests that waited while the engine was paused for the train step get the new step, as on
      TorchEngine's live adapter. (VLLMEngine swaps a same-named adapter atomically; requests that
      already run keep the old weights, which it unloads once they finish.)
    - `resolve("model@k")` names exactly step k's weights: adapter `model@k`, loaded from
      `checkpoint_dir(k)` on first use (None: no such checkpoint) and kept until `forget(k)`.
      For the newest step that is a second copy, so a request for `model@k` made during the next
      train step still gets step k.

    The engine must replace a same-named adapter on `add_adapter` (VLLMEngine does; TorchEngine
    refuses). Thread-safe.

    With `merged=True` (VLLMEngineConfig(weight_sync="merged")) the engine holds one set of weights:
    `publish(step, dir)` merges the checkpoint into them (`engine.load_merged`) under the names
    `model` and `model@step`; `resolve` gives `model` and `model@<newest>`, and refuses an older step
    with UnknownAdapterError (a request for `model@k` admitted after step k+1 was merged fails too).
    """

    def __init__(
        self, engine: Any, model: str, checkpoint_dir: Callable[[int], Path | None], *, merged: bool = False
    ) -> None:
        self.engine, self.model, self._checkpoint_dir = engine, model, checkpoint_dir
        self.merged = merged
        self._steps: dict[int, str] = {}  # step -> adapter `model@step`, loaded on request
        self._latest: int | None = None
        self._lock = threading.Lock()

    @property
    def latest_step(self) -> int | None:
        """The newest published step (None before the first `publish`)."""
        return self._latest

    def publish(self, step: int, path: Path) -> str:
        """Hot-load `path` (a peft folder) as the newest step; returns the adapter name (`model`)."""
        with self._lock:
            if self._latest is not None and step <= self._latest:
                raise ValueError(f"step {step} is not newer than the published step {self._latest}")
            if self.merged:
                self.engine.load_merged(Path(path), [self.model, served_name(self.model, step)])
            else:
                self.engine.add_adapter(self.model, Path(path))
            self._latest = step
            return self.model

    def resolve(self, requested: str) -> str:
        """The engine adapter for `model` (the newest step) or `model@step`; raises UnknownAdapterError."""
        try:
            base, step = parse_served_name(requested)
        except InvalidServedNameError as exc:
            raise UnknownAdapterError(str(exc)) from None
        if base != self.model:
            raise UnknownAdapterError(f"{requested!r} is not {self.model!r} or {self.model}@<step>")
        with self._lock:
            if self._latest is None:
                raise UnknownAdapterError(f"{self.model!r} has no published step yet")
            if step is None:
                return self.model
            if self.merged:
                if step != self._latest:
                    raise UnknownAdapterError(
                        f"{self.model!r} serves only its newest step {self._latest} (vLLM weight_sync='merged' "
                        f"holds one set of weights); step {step} needs weight_sync='lora'"
                    )
                return served_name(self.model, step)
            name = self._steps.get(step)
            if name is None:
                path = self._checkpoint_dir(step)
                if path is None:
                    raise UnknownAdapterError(f"{self.model!r} has no checkpoint for step {step}")
                name = served_name(self.model, step)
                self.engine.add_adapter(name, Path(path))
                self._steps[step] = name
            return name

    def served_steps(self, checkpoints: list[int]) -> list[int]:
        """Of the steps that have a checkpoint, those `resolve("model@step")` serves: all of them
        with adapters, the newest published one alone when merged (what `/v1/models` lists)."""
        if not self.merged:
            return list(checkpoints)
        with self._lock:
            return [step for step in checkpoints if step == self._latest]

    def forget(self, step: int) -> None:
        """Unload adapter `model@step` (say, after its checkpoint was deleted); no-op if not loaded."""
        with self._lock:
            name = self._steps.pop(step, None)
            if name is not None:
                self.engine.remove_adapter(name)

    def loaded_steps(self) -> list[int]:
        """Steps loaded as `model@step` adapters (the newest step is also served as `model`)."""
        return sorted(self._steps)
