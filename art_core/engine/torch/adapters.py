"""The torch engine's LoRA adapters: which are loaded, and loading and removing the ones it adds.

`Adapters` owns the engine's model reference, since the first adapter loaded into a plain
transformers model wraps it in a `PeftModel` (which injects LoRA layers into its modules in
place). Adapters are loaded with `is_trainable=False`; the engine removes only those it added (the
trainer's own adapter is not its to remove), never the last one, and every module's training flag
is kept (`modes_kept`: peft's `load_adapter` calls `model.eval()`). Left out: when these run
(`TorchEngine._control` puts them between batches, or runs them at once while paused) and the
merged serving copy (`serving_weights.py`). See docs/architecture.md ("The torch engine").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from art_core.engine.errors import UnknownAdapterError
from art_core.engine.torch.decoding import BASE_ADAPTER
from art_core.engine.torch.serving_weights import peft_model_of

logger = logging.getLogger(__name__)


@contextmanager
def modes_kept(model: torch.nn.Module, eval_inside: bool = False) -> Iterator[None]:
    """Restore every module's training flag on exit (peft's `load_adapter` calls `model.eval()`)."""
    flags = [(module, module.training) for module in model.modules()]
    if eval_inside:
        model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


class Adapters:
    """The model's peft adapters; not locked (the engine calls it from one thread at a time)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        """The model the engine runs (a `PeftModel` once an adapter was loaded into a plain model)."""
        self._added: set[str] = set()

    def names(self) -> list[str]:
        """Names of the loaded peft adapters (including a trainer's own), [] for a plain model."""
        return list(self.model.peft_config) if peft_model_of(self.model) else []

    def load(self, name: str, path: Path) -> None:
        """Load the peft adapter saved in folder `path` under `name`."""
        if name == BASE_ADAPTER or not name:
            raise ValueError(f"{name!r} cannot name an adapter (it is reserved for the base model)")
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path} is not a saved peft adapter (no adapter_config.json there)")
        if name in self.names():
            raise ValueError(f"adapter {name!r} is already loaded; remove_adapter it first or use a new name")
        with modes_kept(self.model):
            if peft_model_of(self.model):
                self.model.load_adapter(str(path), adapter_name=name, is_trainable=False)
            else:
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=name, is_trainable=False
                )
        self._added.add(name)
        logger.info("loaded adapter %s from %s", name, path)

    def delete(self, name: str) -> None:
        """Unload adapter `name`, which `load` loaded."""
        if name not in self.names():
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded: {self.names()}")
        if name not in self._added:
            raise ValueError(
                f"adapter {name!r} was not added by this engine (it is the trainer's); not removing it"
            )
        if len(self.names()) == 1:
            raise ValueError(f"adapter {name!r} is the model's only adapter; peft cannot run without one")
        with modes_kept(self.model):
            self.model.delete_adapter(name)
        self._added.discard(name)
        logger.info("removed adapter %s", name)


__all__ = ["Adapters", "modes_kept"]
