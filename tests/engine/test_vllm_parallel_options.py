"""VLLMEngineConfig passes vLLM's tensor- and data-parallel sizes through to AsyncEngineArgs."""

from __future__ import annotations

import pytest

from art_core.engine.vllm.config import VLLMEngineConfig


def test_parallel_sizes_reach_the_engine_args() -> None:
    args = VLLMEngineConfig(tensor_parallel_size=2, data_parallel_size=4).async_engine_args("m")
    assert args["tensor_parallel_size"] == 2 and args["data_parallel_size"] == 4
    default = VLLMEngineConfig().async_engine_args("m")
    assert "tensor_parallel_size" not in default and "data_parallel_size" not in default  # vLLM's own 1


def test_parallel_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMEngineConfig(tensor_parallel_size=0)
