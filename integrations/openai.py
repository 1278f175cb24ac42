"""The OpenAI client door: tag a client's requests with the active rollout id.

`model.openai_client()` and `model.sync_openai_client()` are tagged already. For a client of
your own pointed at our server, `patch_client(client)` adds an httpx request hook (to that
client's own httpx client only; httpx itself is not patched) that sets `X-Rollout-Id` while a
rollout scope is active. Copies made with `client.with_options(...)` share the hook.
Alternatively point any client at `scope.base_url`.
"""

from __future__ import annotations

import inspect
from typing import TypeVar

from art_core.capture import add_rollout_header, add_rollout_header_async

ClientT = TypeVar("ClientT")


def patch_client(client: ClientT) -> ClientT:
    """Make an `openai.OpenAI` or `openai.AsyncOpenAI` client carry the active rollout id; returns it.

    Idempotent. Requests made outside any rollout scope are sent unchanged.
    """
    # The SDK's own httpx client (an `httpx` or, in openai 3.x, an `httpx2` client: same API).
    http = getattr(client, "_client", None)
    if http is None or not hasattr(http, "event_hooks") or not hasattr(http, "send"):
        raise TypeError(
            f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}; "
            "for other clients point them at `scope.base_url` or send `scope.headers`"
        )
    hook: object = add_rollout_header_async if inspect.iscoroutinefunction(http.send) else add_rollout_header
    hooks = http.event_hooks
    if hook not in hooks["request"]:
        hooks["request"] = [*hooks["request"], hook]
        http.event_hooks = hooks
    return client


__all__ = ["patch_client"]
