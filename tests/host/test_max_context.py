"""`max_context` has one owner: the engine the host builds (capped by EngineConfig), which the server
checks prompts against and the trainer drops over-long sequences by."""

from __future__ import annotations

from pathlib import Path

from art_core.engine.config import EngineConfig
from art_core.host.records import ModelSpec
from art_core.host.service import ModelService
from art_core.host.serving import TorchServing


def test_the_served_limit_is_the_engines_whatever_the_cap(tmp_path: Path) -> None:
    for cap, expected in ((64, 64), (None, 2048), (10**6, 2048)):  # the tiny model handles 2048
        service = ModelService(
            tmp_path / str(cap), TorchServing(EngineConfig(max_context=cap, batch_wait_s=0))
        )
        try:
            hosted = service.register(ModelSpec(project="ctx", name="agent", base_model="tiny-random"))
            assert hosted.loaded.max_context == 2048
            assert hosted.engine.max_context == expected
            assert service.resolve("agent").max_context == expected
            assert service.resolve("agent@0").max_context == expected
        finally:
            service.close()
