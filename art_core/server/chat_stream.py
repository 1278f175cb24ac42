"""Streamed chat completions: the content of a choice as it grows, and OpenAI's chunk and SSE framing.

`ChoiceText` sends only content no later token can change, so a streamed choice ends up with
exactly the plain one's content: its text is an `IncrementalDetokenizer` (no half characters, cut
at a stop string, a possible partial stop held back), and with tool parsing on nothing from the
first `<tool_call>` on and no whitespace the parsed content would strip. Tool calls and the token
fields (`prompt_token_ids`, `token_ids`, ...) come whole in each choice's last chunk.
`streamed_completion` starts the `text/event-stream` once the first tokens are there (earlier
failures are JSON errors; later ones an SSE `{"error": ...}` without `[DONE]`), hands every
`ChatChoice` to `record` before the last choice's last chunk, and cancels the engine's rows when
the client leaves. See docs/architecture.md ("Streaming changes nothing recorded").
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from art_core.engine.config import GenerationRequest
from art_core.engine.deltas import DeltaStream, RowDelta, token_stream
from art_core.engine.detokenizer import IncrementalDetokenizer, held_prefix, settled_text
from art_core.models import tool_format
from art_core.models.chat_template import tool_format_of
from art_core.server.chat_completion import PreparedChat, chat_choice, prepare_chat
from art_core.server.errors import engine_call, engine_error
from art_core.server.openai_format import ChatChoice, ChatCompletionRequest, build_response, logprobs_of
from art_core.server.router import ModelRouter, ServedModel

logger = logging.getLogger(__name__)

TOOL_CALL_TAG = tool_format.OPEN
"""Where streamed content stops when Hermes tool calls are parsed (each format's `ToolFormat.call_start`)."""


class StreamTextError(RuntimeError):
    """The text sent so far is not a prefix of the final content (a tokenizer that decodes a prefix of
    the ids into something that is not a prefix of the whole text)."""


def settled_content(
    text: str, stop: Sequence[str], parse_tools: bool, call_start: str = TOOL_CALL_TAG
) -> str:
    """The part of a partial completion's text that is final content whatever tokens follow; pure."""
    return _tool_settled(settled_text(text, stop), call_start if parse_tools else None)


def _tool_settled(text: str, call_start: str | None) -> str:
    """With tool parsing on (`call_start`, e.g. `<tool_call>`): the content before a possible call,
    stripped as parsed."""
    if call_start is None:
        return text
    tag = text.find(call_start)
    if tag >= 0:
        text = text[:tag]
    return text[: len(text) - held_prefix(text, call_start)].strip()


class ChoiceText:
    """The content of one streamed choice: what can be sent after each batch of new tokens.

    The text is the choice's `IncrementalDetokenizer` (`art_core.engine.detokenizer`, what the
    engine's `Completion.text` comes from): no half characters, cut at a stop string, a possible
    partial stop held back; on top of it, the tool-call rules of the module docstring.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], parse_tools: bool) -> None:
        self.parse_tools = parse_tools
        self.call_start = tool_format_of(tokenizer).call_start if parse_tools else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self.sent = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add the choice's new tokens (the row has not finished); the new content to send ("" if none)."""
        if not self.detokenizer.feed(token_ids):
            return ""
        settled = _tool_settled(self.detokenizer.settled(), self.call_start)
        if len(settled) <= len(self.sent):
            return ""
        return self._advance(settled)

    def rest(self, final_content: str | None) -> str:
        """The rest of the final content (the non-streamed choice's `message.content`)."""
        return self._advance(final_content or "")

    def _advance(self, content: str) -> str:
        if not content.startswith(self.sent):
            raise StreamTextError(
                f"streamed content {self.sent[-40:]!r} is not a prefix of the text {content[:80]!r}...; this "
                "tokenizer does not decode token prefixes into text prefixes: send stream=false"
            )
        new, self.sent = content[len(self.sent) :], content
        return new


def tool_call_deltas(tool_calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's streamed `delta.tool_calls`: each call whole, with its index."""
    return [
        {"index": i, "id": c["id"], "type": c["type"], "function": dict(c["function"])}
        for i, c in enumerate(tool_calls)
    ]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying `data` (a JSON object, or a literal such as "[DONE]")."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# -- the SSE response ---------------------------------------------------------------------------


async def streamed_completion(
    router: ModelRouter,
    req: ChatCompletionRequest,
    record: Callable[[list[ChatChoice]], None],
    rollout_id: str | None = None,
) -> StreamingResponse:
    """The SSE response; it starts once the first tokens are there, so earlier failures are JSON errors."""
    prepared = prepare_chat(router, req, rollout_id)
    stream, first = await engine_call(_open_stream(prepared.served, prepared.request))
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
        self, req: ChatCompletionRequest, prepared: PreparedChat, record: Callable[[list[ChatChoice]], None]
    ) -> None:
        self.req, self.prepared, self.record = req, prepared, record
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.n = prepared.request.params.n
        stop = prepared.request.params.stop
        self.texts = [
            ChoiceText(prepared.served.tokenizer, stop, prepared.parse_tools) for _ in range(self.n)
        ]
        self.finals: dict[int, ChatChoice] = {}
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
                    self.req.model, [c.body for c in self.finals.values()], len(self.prepared.prompt_ids)
                )
                yield sse({**self._envelope([]), "usage": usage["usage"]})
        except Exception as exc:
            yield sse({"error": engine_error(exc).body()})
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
        answered = chat_choice(self.req, self.prepared, delta.index, delta.completion)
        self.finals[delta.index] = answered
        if len(self.finals) == self.n:  # recorded before the client can see the request end
            self.record([self.finals[i] for i in range(self.n)])
        choice, message = answered.body, answered.message
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


__all__ = [
    "TOOL_CALL_TAG",
    "ChoiceText",
    "StreamTextError",
    "settled_content",
    "sse",
    "streamed_completion",
    "tool_call_deltas",
]
