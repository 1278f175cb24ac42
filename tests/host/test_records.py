"""The wire records: `ModelSpec` carries one `LoRAConfig`, spelled flat (ART) or nested, mapped once."""

from __future__ import annotations

import pydantic
import pytest

from art_core.host.records import ModelSpec
from art_core.model import TrainableModel
from art_core.training.config import LoRAConfig

BASE = {"project": "p", "name": "agent", "base_model": "tiny-random"}


def test_the_lora_shape_has_one_home_and_two_spellings() -> None:
    art_style = TrainableModel(**BASE, lora_rank=16)
    assert art_style.lora == LoRAConfig(r=16) and (art_style.lora_rank, art_style.lora_alpha) == (16, 16)
    full = LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "v_proj"), seed=3)
    assert TrainableModel(**BASE, lora=full).spec.lora == full  # dropout, targets, seed reach the host
    assert TrainableModel(**BASE).spec.lora == LoRAConfig()
    with pytest.raises(ValueError, match="not both"):
        TrainableModel(**BASE, lora=full, lora_alpha=8)


def test_the_spec_round_trips_over_json_and_accepts_the_flat_fields() -> None:
    spec = TrainableModel(**BASE, lora=LoRAConfig(r=4, target_modules=("q_proj",))).spec
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
    assert ModelSpec.model_validate({**BASE, "lora_rank": 4, "lora_alpha": 8}).lora == LoRAConfig(
        r=4, alpha=8
    )
    for bad in (
        {"lora_rank": "x"},
        {"lora_rank": 0},
        {"lora": {"r": 2}, "lora_rank": 2},
        {"lora": {"r": -1}},
    ):
        with pytest.raises(pydantic.ValidationError):
            ModelSpec.model_validate({**BASE, **bad})
