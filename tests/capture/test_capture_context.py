"""Capture's one contextvar and one request hook, used by every door (no server needed).

The hook tags only requests to the active rollout's own server: an OpenAI client patched with
`patch_client`, LiteLLM params and LangChain models all follow that rule, so an external host (a
judge, another server) never receives the rollout id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

import art_core.capture.context as capture_context
from art_core.capture import (
    ROLLOUT_ID_HEADER,
    ActiveRollout,
    install_hook,
    request_hook,
    reset_active_rollout,
    rollout_headers,
    set_active_rollout,
    tag_request,
)
from integrations import current_scope
from integrations.litellm import scoped_params
from integrations.openai import patch_client

OURS = "http://127.0.0.1:8123"


@pytest.fixture
def active() -> Iterator[ActiveRollout]:
    rollout = ActiveRollout("r-1", OURS, scope="the scope object")
    token = set_active_rollout(rollout)
    yield rollout
    reset_active_rollout(token)


def test_only_requests_to_the_rollouts_own_server_are_tagged(active: ActiveRollout) -> None:
    ours = httpx.Request("POST", f"{OURS}/v1/chat/completions")
    tag_request(ours)
    assert ours.headers[ROLLOUT_ID_HEADER] == "r-1"
    for elsewhere in ("https://api.openai.com/v1/chat/completions", "http://127.0.0.1:8124/v1/models"):
        request = httpx.Request("POST", elsewhere)
        tag_request(request)
        assert ROLLOUT_ID_HEADER not in request.headers
    explicit = httpx.Request("POST", f"{OURS}/v1/chat/completions", headers={ROLLOUT_ID_HEADER: "mine"})
    tag_request(explicit)
    assert explicit.headers[ROLLOUT_ID_HEADER] == "mine"


def test_headers_for_doors_that_pass_them_follow_the_same_rule(active: ActiveRollout) -> None:
    assert rollout_headers(f"{OURS}/v1") == {ROLLOUT_ID_HEADER: "r-1"}
    assert rollout_headers("http://judge.example/v1") == {}
    params = {"model": "openai/agent", "api_base": f"{OURS}/v1", "extra_headers": {"A": "b"}}
    assert scoped_params(params)["extra_headers"] == {"A": "b", ROLLOUT_ID_HEADER: "r-1"}
    judge = {"model": "openai/judge", "api_base": "http://judge.example/v1"}
    assert scoped_params(judge) == judge
    assert scoped_params({"model": "gpt-4o"}) == {"model": "gpt-4o"}  # a provider's default URL


def test_the_scope_is_reached_from_the_one_contextvar(active: ActiveRollout) -> None:
    assert current_scope() == "the scope object"


def test_outside_a_rollout_nothing_is_tagged_and_a_warning_comes_once_per_server(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture_context, "_warned_servers", set())
    assert current_scope() is None and rollout_headers() == {}
    with caplog.at_level(logging.WARNING, logger="art_core.capture.context"):
        for _ in range(2):
            request = httpx.Request("POST", f"{OURS}/v1/chat/completions")
            tag_request(request, warn_outside_scope=True)
            assert ROLLOUT_ID_HEADER not in request.headers
        tag_request(
            httpx.Request("POST", f"{OURS}/rollouts/r-2/v1/chat/completions"), warn_outside_scope=True
        )
        tag_request(httpx.Request("POST", "http://127.0.0.1:9/v1/x"))  # no warning asked for
    warnings = [r for r in caplog.records if "outside any rollout scope" in r.getMessage()]
    assert len(warnings) == 1 and OURS.removeprefix("http://") in warnings[0].getMessage()


def test_every_door_installs_the_same_hook_once() -> None:
    client = openai.AsyncOpenAI(base_url=f"{OURS}/v1", api_key="k", max_retries=0)
    before = len(client._client.event_hooks["request"])
    assert patch_client(client) is client
    install_hook(client, warn_outside_scope=True)  # the LangChain door on the same client: no second hook
    hooks = client._client.event_hooks["request"]
    assert len(hooks) == before + 1 and isinstance(hooks[-1], capture_context.AsyncRolloutTagger)
    sync = openai.OpenAI(base_url=f"{OURS}/v1", api_key="k", max_retries=0)
    install_hook(sync)
    assert isinstance(sync._client.event_hooks["request"][-1], capture_context.RolloutTagger)
    assert not isinstance(request_hook(is_async=False), capture_context.AsyncRolloutTagger)
    with pytest.raises(TypeError, match="openai.OpenAI"):
        install_hook(object())
