"""OpenAI's chat completion format: the request body in, the `chat.completion` body out; pure.

In: `ChatCompletionRequest` (pydantic), checked by `check_supported` (with `check_fields`: a
field this server does not implement is refused, never silently dropped) and turned into the chat
template's messages (`request_messages`), engine `SamplingParams` (`sampling_params`) and a
decoding constraint (`request_grammar`: `response_format` or a forced `tool_choice`); what is
wrong with it raises `APIError` 400.

Out: `answered_choice` (a `ChatChoice`: the message, the `Turn` built from the engine's
`Completion`, and the JSON choice with our token fields `prompt_token_ids`, `token_ids`,
`token_logprobs`, `served_model`; `build_choice` is that JSON), `build_response` around them, `logprobs_of` (OpenAI's
`logprobs` object, exact token bytes for byte-level BPE), `model_list` (the `/v1/models` body).
The streamed `chat.completion.chunk` framing is in `art_core.server.chat_stream`.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from art_core.engine.finish_reason import FinishReason
from art_core.engine.grammar import (
    Grammar,
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from art_core.engine.protocol import Completion
from art_core.engine.sampling import SamplingParams
from art_core.models.chat_template import tool_format_of
from art_core.models.tool_format import call_pieces, parse_calls
from art_core.rollouts.records import Turn
from art_core.server.errors import APIError

# -- request ------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """One OpenAI chat message; extra keys (tool_calls, tool_call_id, name) are kept."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The body of `POST /v1/chat/completions`; other fields land in `model_extra`, for `check_fields`."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    """vLLM's extension (send it in the openai client's `extra_body`): do not end on end-of-turn/eos,
    so a completion has exactly max_tokens tokens unless `stop` ends it (benchmarks use it)."""


# -- the request field policy -------------------------------------------------------------------

IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",
    }
)
"""Accepted with any value and ignored: they change nothing this server samples or returns.
`parallel_tool_calls` is sent by LangChain (`with_structured_output(method="function_calling")`,
`bind_tools(parallel_tool_calls=False)`): a forced `tool_choice` always gives exactly one call,
but with "auto" a model may still write several (this server does not cut them)."""

NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "top_k": (None, 0, -1),  # vLLM's sampling extensions from here on
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
}
"""Fields accepted only at the values that change nothing (null, 0, empty; these are what the
openai client, LangChain, LiteLLM and LangGraph agents send unless asked otherwise). Any other
value is a 400 naming the field: this server samples without penalties, logit biases, top-k or
min-p, and has no legacy `functions` (use `tools`)."""


def check_fields(req: ChatCompletionRequest) -> None:
    """Refuse (400, `param` = the field) what the request asks for but this server does not do.

    The policy, in one place:
    - Implemented (declared on `ChatCompletionRequest`, checked there and in `check_supported`):
      model, messages, n, temperature, top_p, max_tokens, max_completion_tokens, stop, seed,
      logprobs, top_logprobs, tools, tool_choice, response_format, stream, stream_options and
      vLLM's ignore_eos.
    - Ignored, any value: `IGNORED_FIELDS` (user, metadata, store, service_tier, ...).
    - Only at neutral values: `NEUTRAL_ONLY` (frequency_penalty=0, presence_penalty=0,
      logit_bias={}, ...); any other value is refused.
    - Any other field is refused: silently dropping it would sample something else than asked.
    """
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name not in NEUTRAL_ONLY:
            raise APIError(
                400,
                f"unrecognized request field {name!r}: this server does not implement it (and refuses "
                "rather than ignores it); remove it from the request",
                param=name,
            )
        neutral = NEUTRAL_ONLY[name]
        if not any(type(value) is not bool and value == ok for ok in neutral):
            accepted = " or ".join(json.dumps(ok) for ok in neutral)
            raise APIError(
                400,
                f"{name}={_shown(value)} is not supported by this server: only {accepted} (no effect) "
                "is accepted",
                param=name,
            )


def _shown(value: Any, limit: int = 80) -> str:
    """A request value as the client wrote it (JSON), cut to `limit` characters."""
    try:
        text = json.dumps(value)
    except RecursionError:  # nested deeper than json can write back
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_supported(req: ChatCompletionRequest) -> None:
    """Reject (400) what this server does not implement yet (see `check_fields` for the policy)."""
    check_fields(req)
    constrained = (
        req.tool_choice not in (None, "auto", "none")
        or (req.response_format or {}).get("type", "text") != "text"
    )
    if req.ignore_eos and constrained:
        raise APIError(
            400,
            "ignore_eos cannot be combined with response_format or a forced tool_choice (a constrained "
            "completion ends when its grammar does)",
            param="ignore_eos",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


def request_grammar(req: ChatCompletionRequest, tokenizer: Any) -> Grammar | None:
    """The decoding constraint a request asks for: a forced tool call, a JSON schema, or none."""
    try:
        if req.tool_choice not in (None, "auto", "none"):
            pieces = call_pieces(tool_format_of(tokenizer), tokenizer.get_added_vocab())
            return tool_call_grammar(req.tools or [], req.tool_choice, pieces=pieces)
        kind = (req.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return json_object_grammar()
        if kind == "json_schema":
            spec = (req.response_format or {}).get("json_schema") or {}
            if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
                raise GrammarError(
                    "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
                )
            return json_schema_grammar(spec["schema"], str(spec.get("name", "response")))
        raise GrammarError(
            f"unknown response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'"
        )
    except GrammarError as exc:
        param = "tool_choice" if req.tool_choice not in (None, "auto", "none") else "response_format"
        raise APIError(400, str(exc), param=param) from exc


def request_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for the chat template ("developer" becomes "system")."""
    out = []
    for message in req.messages:
        m = message.model_dump(exclude_none=True)
        if m["role"] == "developer":
            m["role"] = "system"
        out.append(m)
    return out


def sampling_params(
    req: ChatCompletionRequest, tokenizer: Any, prompt_len: int, max_context: int
) -> SamplingParams:
    """SamplingParams for the request; max_tokens defaults to the rest of the context window."""
    room = max(1, max_context - prompt_len)
    requested = req.max_completion_tokens or req.max_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    eos = None if req.ignore_eos else getattr(tokenizer, "eos_token_id", None)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=min(requested or room, room),
            stop=stop,
            stop_token_ids=() if eos is None else (int(eos),),
            seed=req.seed,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            ignore_eos=req.ignore_eos,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


# -- response -----------------------------------------------------------------------------------


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token (exact for byte-level BPE; else its decoded text as UTF-8)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def logprobs_content(completion: Completion, tokenizer: Any) -> dict[str, Any]:
    """OpenAI's `choice.logprobs`: one entry per sampled token, with its top alternatives."""
    return logprobs_of(tokenizer, completion.token_ids, completion.logprobs, completion.top_logprobs)


def logprobs_of(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
) -> dict[str, Any]:
    """OpenAI's `logprobs` object for these sampled tokens (a whole choice, or one streamed chunk)."""
    content = []
    for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs, strict=True):
        entry = _token_entry(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, i, lp) for i, lp in top]
        content.append(entry)
    return {"content": content, "refusal": None}


@dataclass(frozen=True)
class ChatChoice:
    """One answered choice: the message the client gets, the exact token record behind it (built
    from the engine's `Completion`, never parsed back from the JSON) and the JSON choice."""

    message: dict[str, Any]
    """The assistant message: role, content and, when parsed, tool_calls."""
    turn: Turn
    """The prompt and sampled ids with their logprobs: what a rollout records and trains on."""
    body: dict[str, Any]
    """OpenAI's choice dict plus our token fields, rendered from `message` and `turn`."""


def answered_choice(
    index: int,
    completion: Completion,
    tokenizer: Any,
    *,
    prompt_ids: list[int],
    served_model: str,
    with_logprobs: bool = False,
    parse_tools: bool = False,
) -> ChatChoice:
    """The choice for a completion: message, token record and JSON; pure."""
    content: str | None = completion.text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_calls(completion.text, tool_format_of(tokenizer))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    reason = FinishReason.TOOL_CALLS if tool_calls else completion.finish_reason
    turn = Turn(
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        model=served_model,
        finish_reason=str(reason),
    )
    body = {
        "index": index,
        "message": message,
        "finish_reason": turn.finish_reason,
        "logprobs": logprobs_content(completion, tokenizer) if with_logprobs else None,
        "prompt_token_ids": list(turn.prompt_ids),
        "token_ids": list(turn.completion_ids),
        "token_logprobs": list(turn.logprobs),
        "served_model": turn.model,
    }
    return ChatChoice(message, turn, body)


def build_choice(
    index: int,
    completion: Completion,
    tokenizer: Any,
    *,
    prompt_ids: list[int],
    served_model: str,
    with_logprobs: bool = False,
    parse_tools: bool = False,
) -> dict[str, Any]:
    """One OpenAI choice dict (plus our token fields) for a completion (`answered_choice(...).body`); pure."""
    return answered_choice(
        index,
        completion,
        tokenizer,
        prompt_ids=prompt_ids,
        served_model=served_model,
        with_logprobs=with_logprobs,
        parse_tools=parse_tools,
    ).body


def build_response(model: str, choices: list[dict[str, Any]], prompt_len: int) -> dict[str, Any]:
    """The ChatCompletion body around `choices`."""
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens,
        },
    }


def model_list(names: Sequence[str]) -> dict[str, Any]:
    """The `/v1/models` body listing `names`."""
    created = int(time.time())
    data = [{"id": n, "object": "model", "created": created, "owned_by": "art"} for n in names]
    return {"object": "list", "data": data}


__all__ = [
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatMessage",
    "answered_choice",
    "build_choice",
    "build_response",
    "check_fields",
    "check_supported",
    "logprobs_content",
    "logprobs_of",
    "model_list",
    "request_grammar",
    "request_messages",
    "sampling_params",
    "token_bytes",
]
