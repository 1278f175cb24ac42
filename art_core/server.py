"""The OpenAI-compatible HTTP server: `/v1/chat/completions`, `/v1/models`, `/health`, rollout capture.

Every choice carries, beside OpenAI's fields, the exact tokens it came from: `prompt_token_ids`,
`token_ids` (sampled, including the final eos), `token_logprobs` (aligned with `token_ids`) and
`served_model` (the name the client asked for, e.g. "agent-001@3"). Errors use OpenAI's JSON
shape `{"error": {"message", "type", "param", "code"}}`: unknown model 404, bad parameters and
prompts that do not fit 400, a wrong API key 401, engine failures 500. Overload (docs/architecture.md,
"Bounded under load"): an engine at `EngineConfig.max_queued_rows` answers 429, more than
`max_concurrent_requests` HTTP requests in flight (`ConcurrencyLimit`) or a closed engine 503,
each with an integer `Retry-After`.

Rollout capture (see `art_core.capture`): a chat completion sent with an `X-Rollout-Id` header, or
to the rollout-scoped base URL `/rollouts/{id}/v1`, is recorded under that id; `GET
/rollouts/{id}/records` reads the records and `DELETE /rollouts/{id}` returns and forgets them.

`response_format` (`json_object`, `json_schema`) and `tool_choice` ("required" or a named
function) are enforced by constrained decoding (`art_core.grammar`).

Streaming (`stream: true`): `text/event-stream` in OpenAI's `chat.completion.chunk` format. Each
choice (`n` > 1: by index) gets a first chunk with the role, then content deltas as tokens are
sampled (`logprobs` per chunk when asked for), then a last chunk with the finish reason, the tool
calls (parsed as in a plain response; content stops streaming at `<tool_call>`) and the same token
fields as a plain choice; then the usage chunk (`stream_options.include_usage`) and `[DONE]`. The
streamed content equals the plain response's (see `art_core.chat_stream`). Everything that can
fail before the first token fails as a JSON error; a failure mid-stream is an SSE event `{"error":
...}` and the stream ends without `[DONE]`. A rollout-scoped stream is recorded, exactly as a plain
call, before the last choice's last chunk is sent. A client that disconnects cancels the request
(its rows stop decoding). Engines without token streaming (`VLLMEngine`) stream the whole
completion in the last chunk (`art_core.streaming.token_stream`).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _PlainJSONResponse
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from art_core.capture import (
    ROLLOUT_ID_HEADER,
    InvalidRolloutIdError,
    RolloutRecorder,
    RolloutRecords,
    call_record,
    validate_rollout_id,
)
from art_core.chat_stream import ChoiceText, sse, tool_call_deltas
from art_core.chat_template import parse_tool_calls, render_prompt
from art_core.engine import (
    Completion,
    ContextLengthError,
    Engine,
    EngineClosedError,
    EngineOverloadedError,
    GenerationRequest,
    InvalidRequestError,
    UnknownAdapterError,
)
from art_core.grammar import (
    Grammar,
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
    tool_tag_ids,
)
from art_core.sampling import SamplingParams
from art_core.streaming import DeltaStream, RowDelta, token_stream

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CONCURRENT_REQUESTS = 4096
"""Default bound on HTTP requests in flight (`create_app`); past it the server answers 503. Above the
engine's default `max_queued_rows` (2048), so a client normally meets the engine's 429 first."""
UNAVAILABLE_RETRY_AFTER_S = 1
"""`Retry-After` of a 503 (requests in flight at the limit, or the engine closed): a slot frees as
soon as any request ends, so a short fixed wait; a client retries it with its own backoff."""


# -- routing ------------------------------------------------------------------------------------


class UnknownModelError(KeyError):
    """No served model has the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


@dataclass(frozen=True)
class ServedModel:
    """What a model name resolves to."""

    engine: Engine
    """The engine that generates for it."""
    tokenizer: Any
    """Its tokenizer (renders the chat template, decodes tokens)."""
    adapter: str | None
    """The engine adapter to sample with; None = the base model."""
    max_context: int
    """Prompt + completion token limit."""


class ModelRouter(Protocol):
    """Maps the `model` of a request to a served model."""

    def resolve(self, name: str) -> ServedModel:
        """The served model called `name`; raises UnknownModelError."""
        ...

    def model_names(self) -> list[str]:
        """Names listed by `/v1/models`."""
        ...


class StaticRouter:
    """A fixed name -> ServedModel mapping."""

    def __init__(self, models: Mapping[str, ServedModel]) -> None:
        self._models = dict(models)

    def resolve(self, name: str) -> ServedModel:
        if name not in self._models:
            raise UnknownModelError(
                f"The model {name!r} does not exist; served models: {sorted(self._models)}"
            )
        return self._models[name]

    def model_names(self) -> list[str]:
        return list(self._models)


# -- request body -------------------------------------------------------------------------------


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


class JSONResponse(_PlainJSONResponse):
    """Starlette's JSONResponse, except that text which is not valid Unicode (a lone surrogate that a
    client sent as a `\\ud800` escape, echoed in an error or a rollout record) is written as a JSON
    `\\u` escape instead of failing the response with a UnicodeEncodeError (a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})
        """Extra response headers (`Retry-After` on 429 and 503, `Allow` on 405)."""

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


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


# -- app ----------------------------------------------------------------------------------------


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


async def _engine_call(call: Awaitable[T]) -> T:
    """Await an engine call; its errors become APIErrors (`_engine_error`)."""
    try:
        return await call
    except Exception as exc:
        raise _engine_error(exc) from exc


def _engine_error(exc: Exception) -> APIError:
    """The HTTP error for an exception an engine raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, UnknownAdapterError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineClosedError):
        return APIError(
            503,
            f"the engine is not running (is the server shutting down?): {exc}",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    logger.error("generation failed", exc_info=exc)
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


@dataclass(frozen=True)
class _Prepared:
    """A chat completion request checked and turned into an engine request."""

    served: ServedModel
    prompt_ids: list[int]
    request: GenerationRequest
    parse_tools: bool
    """Whether the completion text is parsed for tool calls."""


def _prepare(router: ModelRouter, req: ChatCompletionRequest) -> _Prepared:
    """Everything before generating: checks, model, grammar, prompt, sampling; raises APIError."""
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
    request = GenerationRequest(prompt_ids, params, served.adapter, grammar)
    return _Prepared(served, prompt_ids, request, bool(req.tools) and req.tool_choice != "none")


def _choice(
    req: ChatCompletionRequest, prepared: _Prepared, index: int, completion: Completion
) -> dict[str, Any]:
    return build_choice(
        index,
        completion,
        prepared.served.tokenizer,
        prompt_ids=prepared.prompt_ids,
        served_model=req.model,
        with_logprobs=bool(req.logprobs),
        parse_tools=prepared.parse_tools,
    )


async def chat_completion(router: ModelRouter, req: ChatCompletionRequest) -> dict[str, Any]:
    """Answer one chat completion request (as a JSON-ready dict)."""
    prepared = _prepare(router, req)
    completions = await _engine_call(prepared.served.engine.generate(prepared.request))
    choices = [_choice(req, prepared, i, c) for i, c in enumerate(completions)]
    return build_response(req.model, choices, len(prepared.prompt_ids))


def _authorized(request: Request, api_key: str) -> bool:
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug: still a 500 in OpenAI's shape (Starlette re-raises it afterwards, so it is logged).
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return APIError(500, message, type="server_error").response()


class ConcurrencyLimit:
    """ASGI middleware: past `limit` HTTP requests in flight, answer 503 with `Retry-After` at once.

    A request counts from its start until its response (a streamed body included) has been sent.
    `/health` is exempt, so a prober sees a busy server as alive. The engines' own bound
    (`EngineConfig.max_queued_rows`, HTTP 429) is what clients normally meet; this one keeps the
    process's memory and sockets bounded whatever the route (training routes, many models).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {limit}")
        self.app, self.limit = app, limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = APIError(
                503,
                f"the server is busy: {self.in_flight} requests are in flight, its limit "
                "(max_concurrent_requests); retry after Retry-After seconds or send fewer at once",
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
            )
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def create_app(
    router: ModelRouter,
    *,
    api_key: str | None = None,
    recorder: RolloutRecorder | None = None,
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS,
) -> FastAPI:
    """The FastAPI app; with `api_key`, every route needs `Authorization: Bearer <api_key>`.

    `recorder` keeps the rollout records (a fresh one when None); it is also `app.state.recorder`.
    Past `max_concurrent_requests` HTTP requests in flight, others get 503 (`ConcurrencyLimit`).
    """
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    app = FastAPI(title="art_core OpenAI-compatible server")
    app.add_middleware(ConcurrencyLimit, limit=max_concurrent_requests)
    _install_error_handlers(app)
    recorder = recorder if recorder is not None else RolloutRecorder()
    app.state.recorder = recorder

    if api_key is not None:

        @app.middleware("http")
        async def _auth(request: Request, call_next: Any) -> Any:
            if not _authorized(request, api_key):
                return APIError(401, "Incorrect API key provided", code="invalid_api_key").response()
            return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return _models_body(router)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        rollout_id = _checked_rollout_id(request.headers.get(ROLLOUT_ID_HEADER), "header")
        return await _recorded_completion(router, recorder, body, rollout_id)

    _install_rollout_routes(app, router, recorder)
    return app


def _models_body(router: ModelRouter) -> dict[str, Any]:
    created = int(time.time())
    data = [{"id": n, "object": "model", "created": created, "owned_by": "art"} for n in router.model_names()]
    return {"object": "list", "data": data}


# -- rollout capture ----------------------------------------------------------------------------


def _checked_rollout_id(rollout_id: str | None, where: str) -> str | None:
    if rollout_id is None:
        return None
    try:
        return validate_rollout_id(rollout_id)
    except InvalidRolloutIdError as exc:
        param = ROLLOUT_ID_HEADER if where == "header" else "rollout_id"
        raise APIError(400, str(exc), param=param, code="invalid_rollout_id") from exc


async def _recorded_completion(
    router: ModelRouter, recorder: RolloutRecorder, req: ChatCompletionRequest, rollout_id: str | None
) -> Response:
    """`chat_completion` (or its stream), recorded under `rollout_id` when one is given."""
    seq = recorder.next_seq()

    def record(response: dict[str, Any]) -> None:
        if rollout_id is not None:
            messages = [m.model_dump(exclude_unset=True) for m in req.messages]
            recorder.record(rollout_id, call_record(seq, req.model, messages, req.tools, response))

    if req.stream:
        return await _streamed_completion(router, req, record)
    response = await chat_completion(router, req)
    record(response)
    return JSONResponse(response)


def _install_rollout_routes(app: FastAPI, router: ModelRouter, recorder: RolloutRecorder) -> None:
    """`/rollouts/{id}/v1/...` (an OpenAI base URL that records), plus reading and freeing records."""

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def rollout_chat_completions(rollout_id: str, body: ChatCompletionRequest) -> Response:
        checked = _checked_rollout_id(rollout_id, "path")
        return await _recorded_completion(router, recorder, body, checked)

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def rollout_models(rollout_id: str) -> dict[str, Any]:
        _checked_rollout_id(rollout_id, "path")
        return _models_body(router)

    @app.get("/rollouts/{rollout_id}/records")
    async def rollout_records(rollout_id: str) -> JSONResponse:
        checked = _checked_rollout_id(rollout_id, "path") or rollout_id
        body = RolloutRecords(rollout_id=checked, records=recorder.peek(checked))
        return JSONResponse(body.model_dump(mode="json"))

    @app.delete("/rollouts/{rollout_id}")
    async def forget_rollout(rollout_id: str) -> JSONResponse:
        checked = _checked_rollout_id(rollout_id, "path") or rollout_id
        body = RolloutRecords(rollout_id=checked, records=recorder.pop(checked))
        return JSONResponse(body.model_dump(mode="json"))


# -- streaming ----------------------------------------------------------------------------------


async def _streamed_completion(
    router: ModelRouter, req: ChatCompletionRequest, record: Callable[[dict[str, Any]], None]
) -> StreamingResponse:
    """The SSE response; it starts once the first tokens are there, so earlier failures are JSON errors."""
    prepared = _prepare(router, req)
    stream, first = await _engine_call(_open_stream(prepared.served, prepared.request))
    events = _ChatStream(req, prepared, record).events(stream, first)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # `background` also runs when the client disconnects: the engine then stops decoding the rows.
    return StreamingResponse(
        events, media_type="text/event-stream", headers=headers, background=BackgroundTask(stream.aclose)
    )


async def _open_stream(served: ServedModel, request: GenerationRequest) -> tuple[DeltaStream, list[RowDelta]]:
    stream = token_stream(served.engine, request)
    try:
        return stream, await anext(stream)
    except BaseException:
        await stream.aclose()
        raise


class _ChatStream:
    """One streamed chat completion: engine increments in, `chat.completion.chunk` events out."""

    def __init__(
        self, req: ChatCompletionRequest, prepared: _Prepared, record: Callable[[dict[str, Any]], None]
    ) -> None:
        self.req, self.prepared, self.record = req, prepared, record
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.n = prepared.request.params.n
        stop = prepared.request.params.stop
        self.texts = [
            ChoiceText(prepared.served.tokenizer, stop, prepared.parse_tools) for _ in range(self.n)
        ]
        self.finals: dict[int, dict[str, Any]] = {}
        self.include_usage = bool((req.stream_options or {}).get("include_usage"))

    async def events(self, stream: DeltaStream, first: list[RowDelta]) -> AsyncIterator[str]:
        """Role chunks, content chunks, each choice's last chunk, the usage chunk, `[DONE]`."""
        try:
            for index in range(self.n):
                yield sse(self._chunk(index, {"role": "assistant", "content": ""}))
            increment = first
            while True:
                for delta in increment:
                    chunk = self._delta_chunk(delta)
                    if chunk is not None:
                        yield sse(chunk)
                if len(self.finals) == self.n:
                    break
                following = await anext(stream, None)
                if following is None:
                    raise RuntimeError("the engine's token stream ended before every choice finished")
                increment = following
            if self.include_usage:
                usage = build_response(
                    self.req.model, list(self.finals.values()), len(self.prepared.prompt_ids)
                )
                yield sse({**self._envelope([]), "usage": usage["usage"]})
        except Exception as exc:
            yield sse({"error": _error_body(_engine_error(exc))})
            return
        finally:
            await stream.aclose()
            if len(self.finals) < self.n:
                logger.info(
                    "a streamed chat completion for %r ended with %d of %d choices finished (client gone or "
                    "an error); it is not recorded",
                    self.req.model,
                    len(self.finals),
                    self.n,
                )
        yield sse("[DONE]")

    def _delta_chunk(self, delta: RowDelta) -> dict[str, Any] | None:
        tokenizer = self.prepared.served.tokenizer
        logprobs = None
        if self.req.logprobs:
            logprobs = logprobs_of(tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs)
        text = self.texts[delta.index]
        if delta.completion is None:
            content = text.feed(delta.token_ids)
            if not content and logprobs is None:
                return None
            return self._chunk(delta.index, {"content": content} if content else {}, logprobs=logprobs)
        choice = _choice(self.req, self.prepared, delta.index, delta.completion)
        self.finals[delta.index] = choice
        if len(self.finals) == self.n:  # recorded before the client can see the request end
            choices = [self.finals[i] for i in range(self.n)]
            self.record(build_response(self.req.model, choices, len(self.prepared.prompt_ids)))
        message = choice["message"]
        last: dict[str, Any] = {}
        if rest := text.rest(message["content"]):
            last["content"] = rest
        if message.get("tool_calls"):
            last["tool_calls"] = tool_call_deltas(message["tool_calls"])
        token_fields = {
            k: choice[k] for k in ("prompt_token_ids", "token_ids", "token_logprobs", "served_model")
        }
        return self._chunk(
            delta.index, last, logprobs=logprobs, finish_reason=choice["finish_reason"], **token_fields
        )

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            **fields,
        }
        return self._envelope([choice])

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        return {**body, "usage": None} if self.include_usage else body


def _error_body(error: APIError) -> dict[str, Any]:
    return {"message": error.message, "type": error.type, "param": error.param, "code": error.code}


# -- serving in a thread ------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A server running in a daemon thread."""

    url: str
    """Base URL, e.g. "http://127.0.0.1:8123" (the OpenAI base_url is url + "/v1")."""
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)


KEEP_ALIVE_S = 75
"""Idle keep-alive of our servers' connections (`art serve`, `serve_in_thread`): longer than HTTP clients keep idle ones (httpx,
so the openai client: 5 s), so a client never reuses a connection that the server is closing at
the same moment. uvicorn's default is also 5 s; with equal timeouts a request sent ~5 s after the
previous one races the close (suspected cause of one APIConnectionError in scripts/gpu_check.py,
right after a 4.9 s train step; not reproduced in isolation)."""


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
) -> ServerHandle:
    """Run `app` with uvicorn in a daemon thread (its own event loop); returns once it accepts connections.

    port 0 picks a free port (the socket is bound here, so the port is known before uvicorn starts).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{bound_port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{bound_port} stopped during startup (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server on {host}:{bound_port} did not start within {timeout} s")
        time.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    return ServerHandle(url=f"http://{shown}:{bound_port}", server=server, thread=thread)


__all__ = [
    "MAX_CONCURRENT_REQUESTS",
    "APIError",
    "ChatCompletionRequest",
    "ConcurrencyLimit",
    "ModelRouter",
    "ServedModel",
    "ServerHandle",
    "StaticRouter",
    "UnknownModelError",
    "build_choice",
    "build_response",
    "create_app",
    "serve_in_thread",
]
