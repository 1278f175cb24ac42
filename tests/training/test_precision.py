"""The training matmul precision: what "auto" means, scoping, and its effect on a real train step."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterator

import pytest
import torch

from art_core.models import hardware
from art_core.models.hardware import cpu_bf16_pays, cpu_has_native_bf16, onednn_packs_bf16
from art_core.models.loading import LoadedModel
from art_core.training import precision
from art_core.training.batch import BatchTotals
from art_core.training.config import TrainConfig
from art_core.training.precision import matmul_precision, resolve_precision
from tests.training.test_trainer import make_batch
from tests.training.test_trainer_fast_paths import make_trainer

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

CPU = torch.device("cpu")


def test_auto_is_bf16_exactly_where_bf16_pays_on_this_cpu() -> None:
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_bf16_pays() else "ieee")
    assert resolve_precision("auto", torch.device("cuda")) == "tf32"
    assert resolve_precision("ieee", CPU) == "ieee"


def test_bf16_on_a_cpu_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_bf16_pays", lambda: False)
    assert resolve_precision("auto", CPU) == "ieee"
    with pytest.raises(ValueError, match="native bf16"):
        resolve_precision("bf16", CPU)


def test_unknown_precisions_are_rejected() -> None:
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        TrainConfig(matmul_precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one of"):
        resolve_precision("half", CPU)  # type: ignore[arg-type]


def test_the_setting_is_scoped_and_restored_even_on_error() -> None:
    backend = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    before = backend.fp32_precision
    with matmul_precision("ieee", CPU) as concrete:
        assert concrete == "ieee" and backend.fp32_precision == "ieee"
    assert backend.fp32_precision == before
    with pytest.raises(RuntimeError, match="boom"), matmul_precision("auto", CPU):
        raise RuntimeError("boom")
    assert backend.fp32_precision == before


def _loss_and_grads(tiny_model: LoadedModel, config: TrainConfig) -> tuple[float, torch.Tensor]:
    trainer = make_trainer(tiny_model, True, config, exact=False)
    batch = make_batch()
    loss = trainer.forward_backward(batch.examples, totals=BatchTotals.of(batch.examples))["loss"]
    grads = torch.cat([p.grad.flatten() for p in trainer.params])  # type: ignore[union-attr]
    return loss, grads


def test_a_train_step_uses_the_precision_and_stays_close_to_exact(tiny_model: LoadedModel) -> None:
    config = TrainConfig(learning_rate=1e-2)
    exact_loss, exact = _loss_and_grads(tiny_model, dataclasses.replace(config, matmul_precision="ieee"))
    again_loss, again = _loss_and_grads(tiny_model, dataclasses.replace(config, matmul_precision="ieee"))
    auto_loss, auto = _loss_and_grads(tiny_model, config)
    assert again_loss == exact_loss and torch.equal(again, exact)  # exact mode is deterministic
    if not cpu_bf16_pays():
        assert auto_loss == exact_loss and torch.equal(auto, exact)
        return
    assert not torch.equal(auto, exact), "auto should compute the matmuls in bf16 on this CPU"
    assert auto_loss == pytest.approx(exact_loss, rel=0.05, abs=1e-3)
    cosine = torch.nn.functional.cosine_similarity(auto, exact, dim=0)
    assert cosine > 0.99, f"bf16 matmul gradients point elsewhere (cosine {cosine:.4f})"


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags as the Linux kernel reports them; None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


@pytest.fixture
def fresh_probes() -> Iterator[None]:
    """Clear the cached hardware probes before and after a test that changes what they see."""
    probes = (hardware.cpu_has_native_bf16, hardware.onednn_packs_bf16, hardware.cpu_bf16_speedup)
    for probe in probes:
        probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


@pytest.mark.parametrize("features", [(), ("avx512_bf16",), ("amx_tile",), ("avx512_bf16", "amx_tile")])
@pytest.mark.parametrize("cap", [None, "AVX2", "AVX512_CORE", "AVX512_CORE_BF16", "avx512_core_amx", "ALL"])
def test_native_bf16_follows_the_cpu_features_and_the_onednn_cap(
    monkeypatch: pytest.MonkeyPatch, fresh_probes: None, features: tuple[str, ...], cap: str | None
) -> None:
    monkeypatch.setattr(hardware, "_cpu_feature", lambda name: name in features)
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda: 2.0)  # a CPU where bf16 is faster
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    capped = cap is not None and cap.upper() in ("AVX2", "AVX512_CORE")
    expected = bool(features) and not capped and torch.backends.mkldnn.is_available()
    assert hardware.cpu_has_native_bf16() is expected
    assert resolve_precision("auto", CPU) == ("bf16" if expected else "ieee")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("speedup", [0.5, 1.1, 1.3, 4.4])
def test_bf16_pays_where_it_is_native_and_measures_faster(
    monkeypatch: pytest.MonkeyPatch, fresh_probes: None, native: bool, speedup: float
) -> None:
    """Native bf16 is not enough: on an Intel Xeon with AVX512-BF16 and no AMX a bf16 matmul ran at
    half float32's rate. Without native bf16 nothing is measured (an emulated bf16 matmul is slow)."""
    timed: list[float] = []

    def measured() -> float:
        timed.append(speedup)
        return speedup

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", measured)
    pays = native and speedup >= hardware.BF16_SPEEDUP_NEEDED
    assert hardware.cpu_bf16_pays() is pays
    assert hardware.cpu_bf16_pays() is pays and len(timed) == int(native)  # measured once, if at all
    assert resolve_precision("auto", CPU) == ("bf16" if pays else "ieee")
    if native:  # an explicit "bf16" is the user's choice wherever bf16 is native, paying or not
        assert resolve_precision("bf16", CPU) == "bf16"


def test_the_bf16_speedup_is_a_real_measurement_and_decides_where_bf16_is_emulated() -> None:
    """The probe times real matmuls; where bf16 is emulated (no native bf16, or oneDNN capped below
    it, as in CI's ISA reruns) it must measure slower than float32."""
    speedup = hardware.bf16_matmul_speedup((32, 256, 512), repeats=3)
    assert math.isfinite(speedup) and speedup > 0
    if not cpu_has_native_bf16() and torch.backends.mkldnn.is_available():
        assert speedup < hardware.BF16_SPEEDUP_NEEDED, "an emulated bf16 matmul measured faster than float32"
        assert cpu_bf16_pays() is False


def test_native_bf16_agrees_with_the_cpus_own_flags() -> None:
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    cap = hardware.onednn_isa_cap()
    native = bool(flags & {"avx512_bf16", "amx_bf16"}) and (
        cap is None or cap in hardware.BF16_NATIVE_ISA_CAPS
    )
    assert cpu_has_native_bf16() is native


def test_bf16_packing_agrees_with_the_cpus_own_flags() -> None:
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    # torch packs bf16 weights with AVX512BW+VL+DQ or with AVX-NE-CONVERT (mkldnn_bf16_device_check),
    # each only where oneDNN's ISA cap, if set, reaches the ISA that has them: AVX512_CORE, AVX2_VNNI_2
    cap = hardware.onednn_isa_cap()
    below_avx512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
    below_ne_convert = {"SSE41", "AVX", "AVX2", "AVX2_VNNI"}
    can = ({"avx512bw", "avx512vl", "avx512dq"} <= flags and cap not in below_avx512) or (
        "avx_ne_convert" in flags and cap not in below_ne_convert
    )
    assert onednn_packs_bf16() is can


@pytest.mark.parametrize("packs", [True, False])
def test_decode_steps_pack_bf16_weights_only_where_onednn_can(
    monkeypatch: pytest.MonkeyPatch, packs: bool
) -> None:
    from art_core.engine.torch import decode_step
    from tests.helpers_models import tiny_llama

    if packs and not onednn_packs_bf16():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU (tested where it can)")
    monkeypatch.setattr(decode_step, "onednn_packs_bf16", lambda: packs)
    model = tiny_llama().to(torch.bfloat16)
    assert decode_step.pack_weights(model) is packs
    assert hasattr(model, decode_step.PACKED_WEIGHTS) is packs
    monkeypatch.setattr(decode_step, "cpu_bf16_pays", lambda: True)
    assert decode_step.pack_weights(tiny_llama()) is False  # float32 is not packed where bf16 is served
    monkeypatch.setattr(decode_step, "cpu_bf16_pays", lambda: False)
    if torch.backends.mkldnn.is_available():  # ...and is where it is not (float32 is served there)
        assert decode_step.pack_weights(tiny_llama()) is True


@pytest.mark.parametrize("native", [True, False])
def test_the_auto_serving_copy_is_bf16_exactly_where_bf16_pays(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    from art_core.engine.torch import serving_weights
    from art_core.engine.torch.serving_copy import serving_copy
    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora

    monkeypatch.setattr(serving_weights, "cpu_bf16_pays", lambda: native)
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8))
    merged = serving_copy(peft, "default", "auto")
    assert merged is not None
    assert next(merged.model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)


def test_a_kernel_cap_in_the_environment_takes_effect() -> None:
    """CI reruns the float-sensitive tests with `ATEN_CPU_CAPABILITY` set: prove that it bites."""
    levels = ["DEFAULT", "AVX2", "AVX512"]
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    if cap not in levels:
        pytest.skip("no ATEN_CPU_CAPABILITY cap set (CI's reruns set one)")
    assert levels.index(torch.backends.cpu.get_cpu_capability()) <= levels.index(cap)
