"""Which engine serves a request's `model`: `ServedModel`, the `ModelRouter` protocol, `StaticRouter`.

The server asks its router for every request; `ModelService` (`art_core.host.service`) is the router of
`art serve` and `LocalBackend`, `StaticRouter` a fixed mapping for tests and single-model servers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from art_core.engine.protocol import Engine


class UnknownModelError(KeyError):
    """No served model has the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


@dataclass(frozen=True)
class ServedModel:
    """What a model name resolves to."""

    engine: Engine
    """The engine that generates for it."""
    tokenizer: Any
    """Its tokenizer (renders the chat template, decodes tokens)."""
    adapter: str | None
    """The engine adapter to sample with; None = the base model."""
    max_context: int
    """Prompt + completion token limit."""


class ModelRouter(Protocol):
    """Maps the `model` of a request to a served model."""

    def resolve(self, name: str) -> ServedModel:
        """The served model called `name`; raises UnknownModelError."""
        ...

    def model_names(self) -> list[str]:
        """Names listed by `/v1/models`."""
        ...


class StaticRouter:
    """A fixed name -> ServedModel mapping."""

    def __init__(self, models: Mapping[str, ServedModel]) -> None:
        self._models = dict(models)

    def resolve(self, name: str) -> ServedModel:
        if name not in self._models:
            raise UnknownModelError(
                f"The model {name!r} does not exist; served models: {sorted(self._models)}"
            )
        return self._models[name]

    def model_names(self) -> list[str]:
        return list(self._models)


__all__ = ["ModelRouter", "ServedModel", "StaticRouter", "UnknownModelError"]
