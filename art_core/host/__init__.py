"""The host (composition root): hosted models, their engines and trainers, and the train routes.

`service` (ModelService, HostedModel, ServingConfig) and `routes` (the `/v1/art/models/...` routes of
`art serve`, create_server_app). Exports `ModelService`, `ServingConfig` and `create_server_app`;
lazy, as they import torch. (ModelSpec, TrainResult and InferenceInfo are still in
`art_core.backends.base`; they move to `host/records.py` later.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.host.routes import create_server_app as create_server_app
    from art_core.host.service import ModelService as ModelService
    from art_core.host.service import ServingConfig as ServingConfig

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.host.service": ("ModelService", "ServingConfig"),
        "art_core.host.routes": ("create_server_app",),
    },
)
