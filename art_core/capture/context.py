"""The active rollout and the one request hook that tags requests with it (the client side of capture).

Holds the one contextvar (`ActiveRollout`: the rollout id, the root URL of the server that records
it, and the scope object that set it), the rollout-id rules, the rollout-scoped URLs, and the one
way a request is tagged: `tag_request` adds `X-Rollout-Id` only to requests for the rollout's own
server (elsewhere the id would leave orphaned records there, or leak to a third party such as an
external judge), and can warn once per server about calls made outside any rollout.
`install_hook(client)` puts it on an OpenAI client; `rollout_headers(url)` gives the same header to
doors that pass headers themselves (LiteLLM). Every door uses these: `TrainableModel`'s clients,
`integrations.openai`, `integrations.litellm`, LangChain's `chat_models`, `integrations.scope`.
Left out: the records and the recorder (the package's `__init__`) and the scope (`integrations.scope`).
"""

from __future__ import annotations

import inspect
import logging
import re
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)

ROLLOUT_ID_HEADER = "X-Rollout-Id"
"""The request header that names the rollout a chat completion belongs to."""

_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class InvalidRolloutIdError(ValueError):
    """A rollout id that is not 1-64 characters of letters, digits, `_` and `-`."""


def validate_rollout_id(rollout_id: str) -> str:
    """Return `rollout_id` if it is 1-64 characters of `[A-Za-z0-9_-]`, else raise InvalidRolloutIdError."""
    if not isinstance(rollout_id, str) or not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise InvalidRolloutIdError(
            f"invalid rollout id {rollout_id!r}: use 1-64 characters of letters, digits, '_' and '-'"
        )
    return rollout_id


def server_root(base_url: str | None) -> str:
    """The server's root URL from an OpenAI base URL ending in `/v1` (None: the model is not registered)."""
    if base_url is None:
        raise ValueError("no inference base URL: register the model first (`await model.register(backend)`)")
    url = base_url.rstrip("/")
    if not url.endswith("/v1"):
        raise ValueError(f"expected an OpenAI base URL ending in '/v1', got {base_url!r}")
    return url[: -len("/v1")]


def rollout_base_url(base_url: str | None, rollout_id: str) -> str:
    """The rollout-scoped OpenAI base URL: `<server>/rollouts/<id>/v1`."""
    return f"{server_root(base_url)}/rollouts/{validate_rollout_id(rollout_id)}/v1"


# -- the active rollout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ActiveRollout:
    """The rollout the current context belongs to."""

    id: str
    """The rollout id requests are recorded under."""
    server_url: str
    """Root URL of the server that records it, without `/v1` (e.g. `http://127.0.0.1:8000`)."""
    scope: Any = field(default=None, compare=False, repr=False)
    """The scope object that made it active (`integrations.scope.RolloutScope`), if any."""

    def records_on(self, url: str | httpx.URL | None) -> bool:
        """Whether a request to `url` goes to the server that records this rollout."""
        return url is not None and str(url).startswith(self.server_url + "/")


_ACTIVE: ContextVar[ActiveRollout | None] = ContextVar("art_active_rollout", default=None)


def active_rollout() -> ActiveRollout | None:
    """The rollout of the current context (task or thread started with a copied context), or None."""
    return _ACTIVE.get()


def set_active_rollout(rollout: ActiveRollout | None) -> Token[ActiveRollout | None]:
    """Make `rollout` active in the current context; undo with `reset_active_rollout(token)`."""
    return _ACTIVE.set(rollout)


def reset_active_rollout(token: Token[ActiveRollout | None]) -> None:
    _ACTIVE.reset(token)


def rollout_headers(url: str | None = None) -> dict[str, str]:
    """`{"X-Rollout-Id": id}` inside a rollout scope for a request to `url` on the rollout's own
    server (None: any URL), else `{}`."""
    rollout = _ACTIVE.get()
    if rollout is None or (url is not None and not rollout.records_on(url.rstrip("/") + "/")):
        return {}
    return {ROLLOUT_ID_HEADER: rollout.id}


# -- the request hook -----------------------------------------------------------------------------

_warned_servers: set[str] = set()
"""Servers already warned about calls outside any rollout (warned once per server and process)."""

OUTSIDE_SCOPE_HINT = (
    "Make the call inside a rollout (`async with rollout(model)`, or `langgraph_rollout(model)` on the "
    "graph or on the function that invokes it); pass warn_outside_scope=False for evaluation calls"
)


def tag_request(request: httpx.Request, *, warn_outside_scope: bool = False) -> None:
    """Tag `request` with the active rollout id when it goes to that rollout's own server.

    A header the caller set explicitly is left alone. Outside any rollout, `warn_outside_scope`
    warns once per server that the call is not captured (except for rollout-scoped URLs).
    """
    rollout = _ACTIVE.get()
    if rollout is not None:
        if rollout.records_on(request.url) and ROLLOUT_ID_HEADER not in request.headers:
            request.headers[ROLLOUT_ID_HEADER] = rollout.id
        return
    server = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
    if warn_outside_scope and "/rollouts/" not in request.url.path and server not in _warned_servers:
        _warned_servers.add(server)
        logger.warning(
            "a client of the trained model at %s was called outside any rollout scope, so the call is "
            "not captured for training. %s (warned once per server)",
            server,
            OUTSIDE_SCOPE_HINT,
        )


class RolloutTagger:
    """httpx request hook (sync clients): `tag_request` with this hook's `warn_outside_scope`."""

    def __init__(self, warn_outside_scope: bool = False) -> None:
        self.warn_outside_scope = warn_outside_scope

    def __call__(self, request: httpx.Request) -> None:
        tag_request(request, warn_outside_scope=self.warn_outside_scope)


class AsyncRolloutTagger(RolloutTagger):
    """httpx request hook (async clients); see `RolloutTagger`."""

    async def __call__(self, request: httpx.Request) -> None:  # type: ignore[override]
        tag_request(request, warn_outside_scope=self.warn_outside_scope)


def request_hook(*, is_async: bool, warn_outside_scope: bool = False) -> RolloutTagger:
    """The tagging hook for an httpx client (`event_hooks={"request": [hook]}`)."""
    return (AsyncRolloutTagger if is_async else RolloutTagger)(warn_outside_scope)


def add_rollout_header(request: httpx.Request) -> None:
    """httpx request hook (sync clients): `tag_request` without the outside-scope warning."""
    tag_request(request)


async def add_rollout_header_async(request: httpx.Request) -> None:
    """httpx request hook (async clients); see `add_rollout_header`."""
    tag_request(request)


def install_hook(client: Any, *, warn_outside_scope: bool = False) -> None:
    """Add the tagging hook to an `openai.OpenAI`/`AsyncOpenAI` client's own httpx client; idempotent.

    Only that client is changed (httpx itself is not patched); copies made with
    `client.with_options(...)` share the hook.
    """
    # The SDK's own httpx client (an `httpx` or, in openai 3.x, an `httpx2` client: same API).
    http = getattr(client, "_client", None)
    if http is None or not hasattr(http, "event_hooks") or not hasattr(http, "send"):
        raise TypeError(
            f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}; "
            "for other clients point them at `scope.base_url` or send `scope.headers`"
        )
    hooks = http.event_hooks
    if any(isinstance(hook, RolloutTagger) for hook in hooks["request"]):
        return
    hook = request_hook(
        is_async=inspect.iscoroutinefunction(http.send), warn_outside_scope=warn_outside_scope
    )
    hooks["request"] = [*hooks["request"], hook]
    http.event_hooks = hooks


__all__ = [
    "ROLLOUT_ID_HEADER",
    "ActiveRollout",
    "AsyncRolloutTagger",
    "InvalidRolloutIdError",
    "RolloutTagger",
    "active_rollout",
    "add_rollout_header",
    "add_rollout_header_async",
    "install_hook",
    "request_hook",
    "reset_active_rollout",
    "rollout_base_url",
    "rollout_headers",
    "server_root",
    "set_active_rollout",
    "tag_request",
    "validate_rollout_id",
]
