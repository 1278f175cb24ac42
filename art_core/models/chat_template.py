"""The chat format: a ChatML template with Hermes-style tool calls, and its parser.

Tool calls travel as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks inside
assistant text (Qwen2.5 / Hermes style). Models whose own template cannot render tools
(SmolLM2) get `HERMES_TOOL_TEMPLATE`; `parse_tool_calls` turns sampled text back into OpenAI
`tool_calls`, and `tool_call_text` is the exact inverse the template uses for rendering.

Exact-token property: an assistant message with plain content renders as the generation
prompt `<|im_start|>assistant\\n`, the content, then `<|im_end|>`, so prompt + sampled tokens
are a token prefix of the next turn's prompt.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

logger = logging.getLogger(__name__)

_DEFAULT_SYSTEM_PLACEHOLDER = "__ART_DEFAULT_SYSTEM__"

_TEMPLATE_SOURCE = """\
{%- if default_system_message is defined %}
    {%- set system_message = default_system_message %}
{%- else %}
    {%- set system_message = __ART_DEFAULT_SYSTEM__ %}
{%- endif %}
{%- set loop_messages = messages %}
{%- if messages and messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if system_message %}
        {{- system_message + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif system_message %}
    {{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if message.content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": ' + tool_call.name | tojson + ', "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def hermes_tool_template(default_system: str = "") -> str:
    """Our ChatML tool template, with `default_system` used when a conversation has no system message.

    The default can also be overridden per call: `apply_chat_template(..., default_system_message=...)`.
    """
    return _TEMPLATE_SOURCE.replace(
        _DEFAULT_SYSTEM_PLACEHOLDER, json.dumps(default_system, ensure_ascii=False)
    )


HERMES_TOOL_TEMPLATE: str = hermes_tool_template("")
"""ChatML + Hermes tool calls, no default system prompt (a system turn appears only when given or with tools)."""

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_PROBE = "art_probe_7f3a"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"{_PROBE}_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "probe question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_probe",
                "type": "function",
                "function": {"name": f"{_PROBE}_tool", "arguments": {"q": f"{_PROBE}_argument"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_probe", "content": f"{_PROBE}_result"},
]


def _probe_render(tokenizer: Any) -> str | None:
    """The tokenizer's rendering of a probe tool conversation, or None when it has no template or fails."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return str(tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS, tokenize=False))
    except Exception as exc:  # any template error means: cannot render tools
        logger.debug("chat template failed on the tool probe: %s", exc)
        return None


def _default_system_of(tokenizer: Any) -> str:
    """The system prompt a ChatML template adds on its own when a conversation has none ("" if none)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
    except Exception:
        return ""
    head = "<|im_start|>system\n"
    if not text.startswith(head) or "<|im_end|>" not in text:
        return ""
    return str(text[len(head) : text.index("<|im_end|>")])


def ensure_tool_template(tokenizer: Any) -> None:
    """Install our tool template on `tokenizer` unless its own template already renders tools.

    A replaced ChatML template keeps its default system prompt (SmolLM2's "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face").
    """
    text = _probe_render(tokenizer)
    if text is not None and all(f"{_PROBE}_{s}" in text for s in ("tool", "argument", "result")):
        if "<tool_call>" not in text:
            logger.warning(
                "Keeping the model's own tool template, but it does not use <tool_call> blocks; "
                "parse_tool_calls will not find tool calls in its completions."
            )
        return
    default_system = _default_system_of(tokenizer)
    logger.info("Installing the Hermes tool chat template (default system prompt: %r)", default_system)
    tokenizer.chat_template = hermes_tool_template(default_system)


def _content_text(content: Any) -> str:
    """Message content as text: OpenAI parts (`[{"type": "text", ...}]`) joined, None as "", other values as JSON."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return json.dumps(content, ensure_ascii=False)


def _parse_arguments(arguments: Any) -> Any:
    """OpenAI's JSON-string arguments as an object for rendering; a non-JSON string is kept verbatim."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return {} if arguments is None else arguments


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of OpenAI messages the way templates expect them: text content, arguments as objects."""
    out = []
    for message in messages:
        m = dict(message)
        m["content"] = _content_text(m.get("content"))
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function", call))
                fn["arguments"] = _parse_arguments(fn.get("arguments"))
                call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text the tokenizer's chat template renders for OpenAI-style `messages`."""
    return str(
        tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    )


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the rendered conversation (special tokens as written by the template, nothing added)."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _call_json(name: str, arguments: Any) -> str:
    """The JSON object inside a `<tool_call>` block, formatted exactly as the template does."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + args + "}"


def tool_call_text(tool_calls: list[dict[str, Any]]) -> str:
    """The assistant text for `tool_calls` (OpenAI format or `{name, arguments}`), as the template renders it."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function", call)
        blocks.append(
            "<tool_call>\n" + _call_json(fn["name"], _parse_arguments(fn.get("arguments"))) + "\n</tool_call>"
        )
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


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split completion text into (content without the valid tool-call blocks or None, OpenAI tool calls).

    Blocks whose JSON is malformed, or that lack a name, stay in the content; no exception is raised.
    """
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    last = 0
    for match in _TOOL_CALL_RE.finditer(text):
        call = _tool_call_from_json(match.group(1))
        if call is None:
            continue
        calls.append(call)
        pieces.append(text[last : match.start()])
        last = match.end()
    pieces.append(text[last:])
    content = "".join(pieces).strip()
    return (content or None), calls
