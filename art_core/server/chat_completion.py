"""One chat completion: an OpenAI request checked, routed, rendered and generated; errors are APIErrors.

`prepare_chat` does everything before generating (supported options, the model, the decoding
constraint, the prompt and its length, sampling params) and gives a `PreparedChat`; then
`chat_completion` awaits the engine for the plain JSON body, and `art_core.server.chat_stream` streams the
same completion as server-sent events. Both build each choice with `chat_choice`: the message, the
exact token record (`Turn`, from the engine's `Completion`) and the JSON, so a recorded rollout
never parses our own response back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art_core.engine.config import GenerationRequest
from art_core.engine.protocol import Completion
from art_core.models.chat_template import render_prompt
from art_core.server.errors import APIError, engine_call
from art_core.server.openai_format import (
    ChatChoice,
    ChatCompletionRequest,
    answered_choice,
    build_response,
    check_supported,
    request_grammar,
    request_messages,
    sampling_params,
)
from art_core.server.router import ModelRouter, ServedModel, UnknownModelError


@dataclass(frozen=True)
class PreparedChat:
    """A chat completion request checked and turned into an engine request."""

    served: ServedModel
    prompt_ids: list[int]
    request: GenerationRequest
    parse_tools: bool
    """Whether the completion text is parsed for tool calls."""


def _resolve(router: ModelRouter, name: str) -> ServedModel:
    try:
        return router.resolve(name)
    except UnknownModelError as exc:
        raise APIError(404, str(exc), param="model", code="model_not_found") from exc


def _render(served: ServedModel, req: ChatCompletionRequest) -> list[int]:
    try:
        return render_prompt(served.tokenizer, request_messages(req), req.tools)
    except Exception as exc:  # template errors (jinja, missing keys) are the request's fault
        raise APIError(
            400, f"could not render the messages with the chat template: {exc}", param="messages"
        ) from exc


def affinity_key(req: ChatCompletionRequest, rollout_id: str | None) -> str | None:
    """What keeps a conversation on one inference replica: the rollout id, else the OpenAI `user`
    field (a non-empty string), else None (the prompt's prefix routes it; see `engine.replicas`)."""
    if rollout_id is not None:
        return f"rollout:{rollout_id}"
    user = (req.model_extra or {}).get("user")
    return f"user:{user}" if isinstance(user, str) and user else None


def prepare_chat(
    router: ModelRouter, req: ChatCompletionRequest, rollout_id: str | None = None
) -> PreparedChat:
    """Everything before generating: checks, model, grammar, prompt, sampling; raises APIError.
    `rollout_id`: the rollout the request belongs to (its replica affinity, `affinity_key`)."""
    check_supported(req)
    served = _resolve(router, req.model)
    grammar = request_grammar(req, served.tokenizer)
    prompt_ids = _render(served, req)
    if len(prompt_ids) > served.max_context - 1:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens but {req.model!r} has a {served.max_context}-token context "
            "window (prompt + completion); shorten the messages",
            param="messages",
            code="context_length_exceeded",
        )
    params = sampling_params(req, served.tokenizer, len(prompt_ids), served.max_context)
    request = GenerationRequest(prompt_ids, params, served.adapter, grammar, affinity_key(req, rollout_id))
    return PreparedChat(served, prompt_ids, request, bool(req.tools) and req.tool_choice != "none")


def chat_choice(
    req: ChatCompletionRequest, prepared: PreparedChat, index: int, completion: Completion
) -> ChatChoice:
    """Choice `index` of the response (`answered_choice` with what the request asked for)."""
    return answered_choice(
        index,
        completion,
        prepared.served.tokenizer,
        prompt_ids=prepared.prompt_ids,
        served_model=req.model,
        with_logprobs=bool(req.logprobs),
        parse_tools=prepared.parse_tools,
    )


async def chat_completion(
    router: ModelRouter, req: ChatCompletionRequest, rollout_id: str | None = None
) -> tuple[list[ChatChoice], dict[str, Any]]:
    """Answer one chat completion request: its choices (token records included) and the JSON body."""
    prepared = prepare_chat(router, req, rollout_id)
    completions = await engine_call(prepared.served.engine.generate(prepared.request))
    choices = [chat_choice(req, prepared, i, c) for i, c in enumerate(completions)]
    return choices, build_response(req.model, [c.body for c in choices], len(prepared.prompt_ids))


__all__ = ["PreparedChat", "affinity_key", "chat_choice", "chat_completion", "prepare_chat"]
