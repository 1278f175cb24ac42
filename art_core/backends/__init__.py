"""Backends: where models are trained and served (`LocalBackend` in-process, `RemoteBackend` over HTTP).

`local` (LocalBackend) and `remote` (RemoteBackend, its typed errors). Both take a `ModelSpec` to
register and a model's name for the rest; the `Backend` protocol they implement is defined by its
caller, `art_core.model`, and the records they exchange are `art_core.host.records`.
Exports `Backend`, `LocalBackend`, `RemoteBackend`, `RemoteError`, `ServingConfig` (with its variants
`TorchServing` and `VLLMServing`), `TrainResult` and `InferenceInfo`. Lazy, so that `art_core.backends.remote` (a light HTTP client) never loads the
in-process host and torch behind `LocalBackend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.backends.local import LocalBackend as LocalBackend
    from art_core.backends.remote import RemoteBackend as RemoteBackend
    from art_core.backends.remote import RemoteError as RemoteError
    from art_core.host.records import InferenceInfo as InferenceInfo
    from art_core.host.records import TrainResult as TrainResult
    from art_core.host.serving import ServingConfig as ServingConfig
    from art_core.host.serving import TorchServing as TorchServing
    from art_core.host.serving import VLLMServing as VLLMServing
    from art_core.model import Backend as Backend

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.host.records": ("InferenceInfo", "TrainResult"),
        "art_core.backends.local": ("LocalBackend",),
        "art_core.backends.remote": ("RemoteBackend", "RemoteError"),
        "art_core.host.serving": ("ServingConfig", "TorchServing", "VLLMServing"),
        "art_core.model": ("Backend",),
    },
)
