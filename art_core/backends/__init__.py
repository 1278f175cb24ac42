"""Backends: where models are trained and served (`LocalBackend` in-process, `RemoteBackend` over HTTP)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Backend": "art_core.backends.base",
    "InferenceInfo": "art_core.backends.base",
    "TrainResult": "art_core.backends.base",
    "LocalBackend": "art_core.backends.local",
    "RemoteBackend": "art_core.backends.remote",
    "RemoteError": "art_core.backends.remote",
    "ServingConfig": "art_core.host.service",
}
__all__ = [
    "Backend",
    "InferenceInfo",
    "LocalBackend",
    "RemoteBackend",
    "RemoteError",
    "ServingConfig",
    "TrainResult",
]

if TYPE_CHECKING:
    from art_core.backends.base import Backend, InferenceInfo, TrainResult
    from art_core.backends.local import LocalBackend
    from art_core.backends.remote import RemoteBackend, RemoteError
    from art_core.host.service import ServingConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'art_core.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
