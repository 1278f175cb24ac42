"""The OpenAI client door: tag a client's requests with the active rollout id.

`model.openai_client()` and `model.sync_openai_client()` are tagged already. For a client of
your own pointed at our server, `patch_client(client)` installs capture's one request hook
(`art_core.capture.install_hook`: on that client's own httpx client only; httpx itself is not
patched), which sets `X-Rollout-Id` on requests to the rollout's own server while a rollout scope
is active, and leaves requests to any other host alone. Copies made with `client.with_options(...)`
share the hook. Alternatively point any client at `scope.base_url`.
"""

from __future__ import annotations

from typing import TypeVar

from art_core.capture import install_hook

ClientT = TypeVar("ClientT")


def patch_client(client: ClientT) -> ClientT:
    """Make an `openai.OpenAI` or `openai.AsyncOpenAI` client carry the active rollout id; returns it.

    Idempotent. Requests made outside any rollout scope, or to another server, are sent unchanged.
    """
    install_hook(client)
    return client


__all__ = ["patch_client"]
