"""The host (composition root): hosted models, their engines and trainers, and the train routes.

`records` (ModelSpec, InferenceInfo, TrainResult, ProgressCallback, WIRE_PREFIX: pydantic, no torch;
what backends and clients exchange with the host), `serving` (ServingConfig = TorchServing | VLLMServing:
which engine serves, with its options), `service` (ModelService, HostedModel) and `routes` (the
`/v1/art/models/...` routes of `art serve`, create_server_app). Exports `ModelService`,
`ServingConfig`, `TorchServing`, `VLLMServing`, `create_server_app` and the records; lazy, as the
service imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports

if TYPE_CHECKING:
    from art_core.host.records import InferenceInfo as InferenceInfo
    from art_core.host.records import ModelSpec as ModelSpec
    from art_core.host.records import TrainResult as TrainResult
    from art_core.host.routes import create_server_app as create_server_app
    from art_core.host.service import ModelService as ModelService
    from art_core.host.serving import ServingConfig as ServingConfig
    from art_core.host.serving import TorchServing as TorchServing
    from art_core.host.serving import VLLMServing as VLLMServing

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "art_core.host.records": ("InferenceInfo", "ModelSpec", "TrainResult"),
        "art_core.host.service": ("ModelService",),
        "art_core.host.serving": ("ServingConfig", "TorchServing", "VLLMServing"),
        "art_core.host.routes": ("create_server_app",),
    },
)
