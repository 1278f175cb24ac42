"""Streamed chat completions: the text of a choice as it grows, and OpenAI's chunk and SSE framing.

A streamed choice must end up with exactly the content of the non-streamed one (`build_choice`),
so `ChoiceText` only sends text that no later token can change:
- not a trailing incomplete UTF-8 character (decoded as U+FFFD until its last byte arrives);
- not a tail that could be the start of a stop string (the stop string and what follows are cut);
- with tool parsing on: nothing from the first `<tool_call>` on, no leading whitespace and no
  trailing whitespace yet (the parsed content is stripped), and no tail that could start the tag.
When the choice ends, `rest(final_content)` is what is left of the final content. Tool calls are
sent whole in the choice's last chunk, parsed exactly as in the non-streamed response.

The last chunk of every choice also carries the same token fields as a non-streamed choice
(`prompt_token_ids`, `token_ids`, `token_logprobs`, `served_model`), so a client can rebuild the
exact record; earlier chunks carry no token ids.

`streamed_completion` is the `text/event-stream` response: it starts once the engine's first
tokens are there (`art_core.engine.torch.streaming.token_stream`), so everything that fails before is a JSON
error; a failure midway is an SSE `{"error": ...}` event and the stream ends without `[DONE]`. The
whole response is handed to `record` before the last choice's last chunk is sent; closing the
response (the client gone) cancels the engine's rows.
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
from art_core.engine.sampling import find_stop
from art_core.engine.torch.streaming import DeltaStream, RowDelta, token_stream
from art_core.models import tool_format
from art_core.server.chat_completion import PreparedChat, chat_choice, prepare_chat
from art_core.server.errors import engine_call, engine_error
from art_core.server.openai_format import ChatCompletionRequest, build_response, logprobs_of
from art_core.server.router import ModelRouter, ServedModel

logger = logging.getLogger(__name__)

TOOL_CALL_TAG = tool_format.OPEN
"""Where streamed content stops when tool calls are parsed (the Hermes format, `models.tool_format`)."""


class StreamTextError(RuntimeError):
    """The text sent so far is not a prefix of the final content (a tokenizer that decodes a prefix of
    the ids into something that is not a prefix of the whole text)."""


def _held_prefix(text: str, pattern: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `pattern`."""
    for k in range(min(len(pattern) - 1, len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


def settled_content(text: str, stop: Sequence[str], parse_tools: bool) -> str:
    """The part of a partial completion's text that is final content whatever tokens follow; pure."""
    text = text.rstrip("\ufffd")
    cut = find_stop(text, tuple(stop))
    if cut is not None:
        text = text[:cut]
    held = max((_held_prefix(text, s) for s in stop), default=0)
    if parse_tools:
        tag = text.find(TOOL_CALL_TAG)
        if tag >= 0:
            text, held = text[:tag], 0
        held = max(held, _held_prefix(text, TOOL_CALL_TAG))
    text = text[: len(text) - held]
    return text.strip() if parse_tools else text


class ChoiceText:
    """The content of one streamed choice: what can be sent after each batch of new tokens.

    Decoding is incremental (as vLLM's detokenizer): each batch decodes only the ids since the
    previous batch, with the batch before as context (`ids[prefix:]` minus `ids[prefix:read]`, so
    a tokenizer that treats a leading piece specially agrees with itself), and the text grows only
    when it does not end in a half character.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], parse_tools: bool) -> None:
        self.tokenizer, self.stop, self.parse_tools = tokenizer, tuple(stop), parse_tools
        self.ids: list[int] = []
        self.text = ""
        """The decoded text of `ids[:read]`."""
        self.sent = ""
        self._prefix = self._read = 0

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add the choice's new tokens (the row has not finished); the new content to send ("" if none)."""
        self.ids.extend(token_ids)
        context = self._decode(self.ids[self._prefix : self._read])
        grown = self._decode(self.ids[self._prefix :])
        if len(grown) <= len(context) or grown.endswith("\ufffd"):
            return ""
        self.text += grown[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        settled = settled_content(self.text, self.stop, self.parse_tools)
        if len(settled) <= len(self.sent):
            return ""
        return self._advance(settled)

    def _decode(self, ids: list[int]) -> str:
        # As `Completion.text` decodes (art_core.engine.torch.decoding), so that the texts agree.
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

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
    router: ModelRouter, req: ChatCompletionRequest, record: Callable[[dict[str, Any]], None]
) -> StreamingResponse:
    """The SSE response; it starts once the first tokens are there, so earlier failures are JSON errors."""
    prepared = prepare_chat(router, req)
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
        self, req: ChatCompletionRequest, prepared: PreparedChat, record: Callable[[dict[str, Any]], None]
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
        choice = chat_choice(self.req, self.prepared, delta.index, delta.completion)
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


__all__ = [
    "TOOL_CALL_TAG",
    "ChoiceText",
    "StreamTextError",
    "settled_content",
    "sse",
    "streamed_completion",
    "tool_call_deltas",
]
