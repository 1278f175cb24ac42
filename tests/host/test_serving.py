"""`ServingConfig` is a tagged union (`TorchServing` | `VLLMServing`): each engine's options live only
in its own variant, so the combinations that were once refused at run time cannot be built. The flat
`ServingConfig(engine=..., vllm=..., trainer_device=...)` still builds the matching variant."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from art_core.backends import LocalBackend
from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.errors import InvalidRequestError
from art_core.engine.sampling import SamplingParams
from art_core.engine.vllm.config import VLLMEngineConfig
from art_core.host.records import ModelSpec
from art_core.host.service import ModelService
from art_core.host.serving import ServingConfig, TorchServing, VLLMServing

HAS_VLLM = importlib.util.find_spec("vllm") is not None
CUSTOM = EngineConfig(max_queued_rows=3, prefix_cache_mib=0, max_context=64, batch_wait_s=0)


def test_the_flat_constructor_builds_the_variant_it_names() -> None:
    assert ServingConfig() == TorchServing() == TorchServing(EngineConfig())
    assert ServingConfig(engine="torch") == TorchServing()
    cpu = VLLMEngineConfig(dtype="float32")
    chosen = ServingConfig(engine="vllm", vllm=cpu, trainer_device="cpu")
    assert type(chosen) is VLLMServing and chosen == VLLMServing(vllm=cpu, trainer_device="cpu")
    assert ServingConfig(engine="vllm") == VLLMServing(vllm=VLLMEngineConfig())  # vllm=None: the defaults
    for variant, tag in ((TorchServing(), "torch"), (VLLMServing(), "vllm")):
        assert isinstance(variant, ServingConfig) and variant.engine == tag
    assert chosen.device() == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.trainer_device = "cuda"  # type: ignore[misc]


def test_the_formerly_refused_combinations_are_not_expressible() -> None:
    # TorchEngine options with vLLM serving: VLLMServing has no field for them.
    with pytest.raises(TypeError, match="engine_config"):
        VLLMServing(engine_config=CUSTOM)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="EngineConfig configures TorchEngine: use TorchServing"):
        VLLMServing(vllm=CUSTOM)  # type: ignore[arg-type]
    # vLLM options (or a trainer device) with the torch engine: TorchServing has no field for them.
    for wrong in ({"vllm": VLLMEngineConfig()}, {"trainer_device": "cpu"}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            TorchServing(**wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"vLLM's options go in VLLMServing\(vllm="):
        TorchServing(engine_config=VLLMEngineConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine='vllm' only"):  # the flat spelling, as before
        ServingConfig(engine="torch", trainer_device="cpu")  # type: ignore[call-overload]
    # A vLLM engine that cannot serve LoRA adapters is refused when the config is built, not at register.
    with pytest.raises(ValueError, match="enable_lora=True"):
        VLLMServing(vllm=VLLMEngineConfig(enable_lora=False))


def test_the_service_and_backend_take_one_serving_argument(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"EngineConfig goes in TorchServing\(engine_config=\.\.\.\)"):
        ModelService(tmp_path, CUSTOM)  # type: ignore[arg-type]  # the old positional engine_config
    with pytest.raises(TypeError, match="not both"):
        LocalBackend(tmp_path, engine_config=CUSTOM, serving=VLLMServing())  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="not both"):
        LocalBackend(tmp_path, engine_config=CUSTOM, serving=TorchServing())  # type: ignore[call-overload]
    shorthand = LocalBackend(tmp_path, engine_config=CUSTOM)  # ART-era spelling: short for TorchServing
    assert shorthand.service.serving == TorchServing(engine_config=CUSTOM)
    assert LocalBackend(tmp_path).service.serving == TorchServing()


async def test_a_torch_service_serves_with_its_custom_engine_config(tmp_path: Path) -> None:
    service = ModelService(tmp_path, TorchServing(engine_config=CUSTOM))
    try:
        hosted = service.register(ModelSpec(project="serving", name="agent", base_model="tiny-random"))
        assert hosted.engine.max_context == 64 and service.resolve("agent").max_context == 64
        prompt = hosted.loaded.tokenizer("hello there")["input_ids"]
        params = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=1)
        completions = await hosted.engine.generate(GenerationRequest(prompt, params, adapter="live"))
        assert len(completions) == 3 and all(1 <= len(c.token_ids) <= 4 for c in completions)
        with pytest.raises(InvalidRequestError, match="max_queued_rows=3"):  # the custom admission limit
            await hosted.engine.generate(GenerationRequest(prompt, dataclasses.replace(params, n=4)))
    finally:
        service.close()


def test_art_serve_flags_build_the_torch_variant() -> None:
    from art_core.app.cli import serving_config

    built = serving_config("torch", [], max_queued_rows=8, prefix_cache_mib=0)
    assert built == TorchServing(engine_config=EngineConfig(max_queued_rows=8, prefix_cache_mib=0))
    with pytest.raises(ValueError, match="--max-queued-rows applies to the torch engine"):
        serving_config("vllm", [], max_queued_rows=8)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed here (it lives in .venv-vllm)")
def test_a_vllm_service_is_built_without_starting_an_engine(tmp_path: Path) -> None:
    service = ModelService(
        tmp_path, VLLMServing(vllm=VLLMEngineConfig(max_lora_rank=8), trainer_device="cpu")
    )
    try:
        assert service.serving.engine == "vllm" and service.model_names() == []
        with pytest.raises(
            ValueError, match="above the vLLM engine's max_lora_rank 8"
        ):  # before anything loads
            service.register(
                ModelSpec(project="serving", name="agent", base_model="tiny-random", lora_rank=16)
            )
        assert service.model_names() == []
    finally:
        service.close()
