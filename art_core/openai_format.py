"""OpenAI's chat completion format: the request body in, the `chat.completion` body out; pure.

In: `ChatCompletionRequest` (pydantic; unknown fields ignored), checked by `check_supported` and
turned into the chat template's messages (`request_messages`), engine `SamplingParams`
(`sampling_params`) and a decoding constraint (`request_grammar`: `response_format` or a forced
`tool_choice`); what is wrong with it raises `APIError` 400.

Out: `build_choice` (OpenAI's choice plus our token fields `prompt_token_ids`, `token_ids`,
`token_logprobs`, `served_model`), `build_response` around the choices, `logprobs_of` (OpenAI's
`logprobs` object, exact token bytes for byte-level BPE), `model_list` (the `/v1/models` body).
The streamed `chat.completion.chunk` framing is in `art_core.chat_stream`.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from art_core.api_errors import APIError
from art_core.chat_template import parse_tool_calls
from art_core.engine import Completion
from art_core.grammar import (
    Grammar,
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
    tool_tag_ids,
)
from art_core.sampling import SamplingParams

# -- request ------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """One OpenAI chat message; extra keys (tool_calls, tool_call_id, name) are kept."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The body of `POST /v1/chat/completions`; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

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


def check_supported(req: ChatCompletionRequest) -> None:
    """Reject (400) what this server does not implement yet."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


def request_grammar(req: ChatCompletionRequest, tokenizer: Any) -> Grammar | None:
    """The decoding constraint a request asks for: a forced tool call, a JSON schema, or none."""
    try:
        if req.tool_choice not in (None, "auto", "none"):
            return tool_call_grammar(req.tools or [], req.tool_choice, tag_ids=tool_tag_ids(tokenizer))
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
    eos = getattr(tokenizer, "eos_token_id", None)
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
    """One OpenAI choice dict (plus our token fields) for a completion; pure."""
    content: str | None = completion.text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_tool_calls(completion.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if tool_calls else completion.finish_reason,
        "logprobs": logprobs_content(completion, tokenizer) if with_logprobs else None,
        "prompt_token_ids": list(prompt_ids),
        "token_ids": list(completion.token_ids),
        "token_logprobs": list(completion.logprobs),
        "served_model": served_model,
    }


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
    "ChatCompletionRequest",
    "ChatMessage",
    "build_choice",
    "build_response",
    "check_supported",
    "logprobs_content",
    "logprobs_of",
    "model_list",
    "request_grammar",
    "request_messages",
    "sampling_params",
    "token_bytes",
]
