"""`name@step`: one parser (`art_core.storage.parse_served_name`) for both engine lanes.

`agent-001@²` used to pass the vLLM lane's `str.isdigit` and fail in `int()`, a 500; now every lane
answers a bad name with a 404 that says how to spell one, over real HTTP.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from art_core.engine.errors import UnknownAdapterError
from art_core.engine.vllm.router import VLLMAdapterRouter
from art_core.model import TrainableModel
from art_core.storage import InvalidServedNameError, parse_served_name, served_name
from tests.helpers_serving import served_fixture

served = served_fixture("names", project="names", name="agent-001")
ASYNC = pytest.mark.asyncio(loop_scope="module")
BAD_NAMES = ["agent-001@²", "agent-001@", "agent-001@x", "agent-001@-1", "agent-001@1@2", "agent-001@٣"]


def test_parse_and_build_agree() -> None:
    assert parse_served_name("agent-001") == ("agent-001", None)
    assert parse_served_name("agent-001@12") == ("agent-001", 12)
    assert parse_served_name(served_name("agent-001", 3)) == ("agent-001", 3)
    assert served_name("agent-001") == "agent-001"
    for bad in BAD_NAMES:
        with pytest.raises(InvalidServedNameError, match="ASCII digits"):
            parse_served_name(bad)


class AdapterLog:
    """A stand-in for VLLMEngine's adapter calls (the router's only use of it): records them."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_adapter(self, name: str, path: Path) -> None:
        self.added.append(name)

    def remove_adapter(self, name: str) -> None:
        self.added.remove(name)


def test_the_vllm_router_uses_the_same_parser(tmp_path: Path) -> None:
    engine = AdapterLog()
    router = VLLMAdapterRouter(engine, "agent-001", lambda step: tmp_path if step == 1 else None)
    router.publish(2, tmp_path)
    assert router.resolve("agent-001") == "agent-001"
    assert router.resolve("agent-001@1") == "agent-001@1" and engine.added == ["agent-001", "agent-001@1"]
    for bad in BAD_NAMES:
        with pytest.raises(UnknownAdapterError, match="ASCII digits"):
            router.resolve(bad)
    with pytest.raises(UnknownAdapterError, match="no checkpoint for step 5"):
        router.resolve("agent-001@5")


class MergeLog(AdapterLog):
    """The same stand-in for a merged VLLMEngine (`load_merged`): records the names merged under."""

    def load_merged(self, path: Path, names: list[str]) -> None:
        self.added = list(names)


def test_a_merged_router_lists_only_the_step_it_serves(tmp_path: Path) -> None:
    """/v1/models lists `name@k` from `served_steps`: every checkpoint with adapters, and with merged
    weights only the newest step (an older `name@k` is a 404 there, so it must not be listed)."""
    checkpoints = [0, 1, 2]
    adapters = VLLMAdapterRouter(AdapterLog(), "agent-001", lambda step: tmp_path)
    adapters.publish(2, tmp_path)
    assert adapters.served_steps(checkpoints) == [0, 1, 2]
    engine = MergeLog()
    merged = VLLMAdapterRouter(engine, "agent-001", lambda step: tmp_path, merged=True)
    assert merged.served_steps(checkpoints) == []  # nothing published yet
    merged.publish(1, tmp_path)
    assert merged.served_steps(checkpoints) == [1]
    merged.publish(2, tmp_path)
    assert merged.served_steps(checkpoints) == [2] and engine.added == ["agent-001", "agent-001@2"]
    for step in merged.served_steps(checkpoints):
        assert merged.resolve(served_name("agent-001", step)) == "agent-001@2"
    with pytest.raises(UnknownAdapterError, match="only its newest step 2"):
        merged.resolve("agent-001@1")


@ASYNC
async def test_a_bad_step_is_a_404_over_http(model: TrainableModel) -> None:
    client = model.openai_client()
    messages = [{"role": "user", "content": "hi"}]
    for bad in BAD_NAMES:
        with pytest.raises(openai.NotFoundError, match="ASCII digits"):
            await client.chat.completions.create(model=bad, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    at_zero = await client.chat.completions.create(model="agent-001@0", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert at_zero.choices[0].message is not None
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{model.inference_base_url}/chat/completions",
            json={"model": "agent-001@²", "messages": messages, "max_tokens": 2},
            headers={"Authorization": f"Bearer {model.inference_api_key}"},
        )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
