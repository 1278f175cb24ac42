"""How trajectories are written into judge prompts: as JSON (the sampled judge) or as plain text.

Pure functions; the prompts built from them are golden-tested in tests/test_ruler*.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True)
    raise TypeError(f"cannot show a {type(value).__name__} to the judge: messages must be JSON-serialisable")


def to_json(value: Any) -> str:
    """One message or tool as written into the prompt: one line, key order kept, UTF-8 as is."""
    return json.dumps(value, ensure_ascii=False, default=_json_default)


def json_lines(items: Sequence[Any]) -> str:
    """A JSON array with one item per line (still valid JSON; easy for the judge to follow)."""
    return "[\n" + ",\n".join(to_json(item) for item in items) + "\n]" if items else "[]"


def common_prefix_length(message_lists: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """Number of leading messages that every list has in common (0 for fewer than two lists)."""
    if len(message_lists) < 2:
        return 0
    first, n = message_lists[0], min(len(m) for m in message_lists)
    for i in range(n):
        if any(to_json(m[i]) != to_json(first[i]) for m in message_lists[1:]):
            return i
    return n


def shared_context_length(message_lists: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """Leading messages shown once as the context: the common prefix of two or more lists; for a
    single list, everything up to its last user message (the rest is the reply being judged)."""
    if len(message_lists) > 1:
        return common_prefix_length(message_lists)
    roles = [m.get("role") for m in message_lists[0]] if message_lists else []
    return max((i + 1 for i, role in enumerate(roles) if role == "user"), default=0)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
        return "\n".join(p for p in parts if p)
    return to_json(content)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    return f"calls {function.get('name', '?')}({function.get('arguments', '')})"


def message_text(message: Mapping[str, Any]) -> str:
    """One message as plain text: `Role: content`, tool calls as `calls name(arguments)`."""
    role = str(message.get("role", "?"))
    text = _content_text(message.get("content")).strip()
    if role == "tool":
        return f"Tool result: {text}"
    calls = [_tool_call_text(c) for c in message.get("tool_calls") or ()]
    if calls:
        return f"{role.capitalize()}: " + "; ".join(([text] if text else []) + calls)
    return f"{role.capitalize()}: {text if text else '(empty)'}"


def context_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The shared start of a conversation for a small judge: the agent's instructions as "The
    assistant was told: ...", user turns as "Question: ...", the rest as `message_text`."""
    lines = []
    for message in messages:
        role, text = message.get("role"), _content_text(message.get("content")).strip()
        if role in ("system", "developer"):
            lines.append(f"The assistant was told: {text}")
        elif role == "user":
            lines.append(f"Question: {text}")
        else:
            lines.append(message_text(message))
    return "\n".join(lines)


def reply_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """What a trajectory did after the shared context, as the judged reply: a single text reply
    as it is, "(no reply)" for nothing or an empty one, several messages one `message_text` a line."""
    if len(messages) == 1 and messages[0].get("role") == "assistant" and not messages[0].get("tool_calls"):
        return _content_text(messages[0].get("content")).strip() or "(no reply)"
    if not messages:
        return "(no reply)"
    return "\n" + "\n".join(message_text(m) for m in messages)


def plain_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages as plain text, one `message_text` a line."""
    return "\n".join(message_text(m) for m in messages) if messages else "(nothing)"


def tools_text(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """The tools as "Tools the assistant could call:" and `- name: description` lines ("" without)."""
    lines = []
    for tool in tools or ():
        function = tool.get("function") or {}
        description = str(function.get("description") or "").strip()
        lines.append(f"- {function.get('name', '?')}" + (f": {description}" if description else ""))
    return "Tools the assistant could call:\n" + "\n".join(lines) if lines else ""


__all__ = [
    "common_prefix_length",
    "context_text",
    "reply_text",
    "json_lines",
    "message_text",
    "plain_text",
    "shared_context_length",
    "to_json",
    "tools_text",
]
