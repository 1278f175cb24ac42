"""The LiteLLM door: calls made with our model's LiteLLM parameters inside a rollout scope.

`model.litellm_completion_params()` called inside a scope already points `api_base` at the
rollout-scoped URL, so `litellm.acompletion(**params, messages=...)` is captured as it is.
Params built before the scope are not: pass them through `scoped_params(params)` (adds the
`X-Rollout-Id` header as `extra_headers` when `api_base` is the rollout's own server, the rule of
capture's one request hook), or call `completion`/`acompletion` from here, which do that for every
call.

LiteLLM 1.110 has no callback that can change the headers of a `completion` call
(`async_pre_request_hook` only runs on the Anthropic messages path, and the logging hooks cannot
modify the request), so this module does not register a global callback.
"""

from __future__ import annotations

from typing import Any

from art_core.capture import rollout_headers


def scoped_params(params: dict[str, Any]) -> dict[str, Any]:
    """A copy of LiteLLM kwargs that also sends the active rollout id to the rollout's own server
    (unchanged outside a scope, and for any other `api_base`)."""
    url = params.get("api_base") or params.get("base_url")
    headers = rollout_headers(str(url)) if url else {}
    if not headers:
        return dict(params)
    return {**params, "extra_headers": {**(params.get("extra_headers") or {}), **headers}}


def completion(**kwargs: Any) -> Any:
    """`litellm.completion` with the active rollout id attached."""
    import litellm

    return litellm.completion(**scoped_params(kwargs))


async def acompletion(**kwargs: Any) -> Any:
    """`litellm.acompletion` with the active rollout id attached."""
    import litellm

    return await litellm.acompletion(**scoped_params(kwargs))


__all__ = ["acompletion", "completion", "scoped_params"]
