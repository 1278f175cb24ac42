"""The Hermes tool-call format, in one place: its tags, and turning calls into text and back.

A tool call travels inside assistant text as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(Qwen2.5 / Hermes style), a tool result as `<tool_response>...</tool_response>`, and a turn ends
with `<|im_end|>`. Holds the tags (`OPEN`, `CLOSE`, `BLOCK_OPEN`, `BLOCK_CLOSE`, `RESPONSE_OPEN`,
`RESPONSE_CLOSE`, `END_OF_TURN`), `format_calls` (the exact text `HERMES_TOOL_TEMPLATE` renders),
`parse_calls` (sampled text back into OpenAI `tool_calls`) and `tag_ids` (the tags' token ids where a
tokenizer has them as added tokens). Its users: the chat template (`models.chat_template`), the
tool-call grammar (`engine.grammar`), the stream's cut-off (`server.chat_stream`), the response
(`server.openai_format`) and the tiny test tokenizer (`models.loading`). Left out: the Jinja
template itself (`models.chat_template`, tested to render exactly `format_calls`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
BLOCK_OPEN = OPEN + "\n"
"""How a call block starts (the tag and a newline), as the template renders it."""
BLOCK_CLOSE = "\n" + CLOSE
"""How a call block ends."""
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
END_OF_TURN = "<|im_end|>"
"""ChatML's end of a turn: the token a completion stops on."""
TAGS = (OPEN, CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
"""The format's tags (the tiny test tokenizer has each as one added token, as Qwen's does)."""

_BLOCK_RE = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def tag_ids(tokenizer: Any) -> tuple[int, int] | None:
    """Ids of `<tool_call>`/`</tool_call>` when the tokenizer has them as added tokens, else None."""
    added = tokenizer.get_added_vocab()
    if OPEN in added and CLOSE in added:
        return int(added[OPEN]), int(added[CLOSE])
    return None


def parse_arguments(arguments: Any) -> Any:
    """OpenAI's JSON-string arguments as an object for rendering; a non-JSON string is kept verbatim."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return {} if arguments is None else arguments


def _call_json(name: str, arguments: Any) -> str:
    """The JSON object inside a `<tool_call>` block, formatted exactly as the template does."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + args + "}"


def format_calls(tool_calls: list[dict[str, Any]]) -> str:
    """The assistant text for `tool_calls` (OpenAI format or `{name, arguments}`), as the template renders it."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function", call)
        blocks.append(BLOCK_OPEN + _call_json(fn["name"], parse_arguments(fn.get("arguments"))) + BLOCK_CLOSE)
    return "\n".join(blocks)


def _tool_call_from_json(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside a block, or None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split completion text into (content without the valid tool-call blocks or None, OpenAI tool calls).

    Blocks whose JSON is malformed, or that lack a name, stay in the content; no exception is raised.
    """
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    last = 0
    for match in _BLOCK_RE.finditer(text):
        call = _tool_call_from_json(match.group(1))
        if call is None:
            continue
        calls.append(call)
        pieces.append(text[last : match.start()])
        last = match.end()
    pieces.append(text[last:])
    content = "".join(pieces).strip()
    return (content or None), calls


__all__ = [
    "BLOCK_CLOSE",
    "BLOCK_OPEN",
    "CLOSE",
    "END_OF_TURN",
    "OPEN",
    "RESPONSE_CLOSE",
    "RESPONSE_OPEN",
    "TAGS",
    "format_calls",
    "parse_arguments",
    "parse_calls",
    "tag_ids",
]
