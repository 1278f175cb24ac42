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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from art_core.sampling import find_stop

TOOL_CALL_TAG = "<tool_call>"
"""Where streamed content stops when tool calls are parsed (the Hermes format, `chat_template`)."""


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
        # As `Completion.text` decodes (art_core.decoding), so that the texts agree.
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


__all__ = ["TOOL_CALL_TAG", "ChoiceText", "StreamTextError", "settled_content", "sse", "tool_call_deltas"]
