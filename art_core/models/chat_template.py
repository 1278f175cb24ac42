"""The chat template: ChatML with Hermes-style tool calls, and rendering OpenAI messages with it.

Holds `HERMES_TOOL_TEMPLATE` (for models whose own template cannot render tools, e.g. SmolLM2),
`ensure_tool_template` (which template a tokenizer keeps, by a probe render) and `render_prompt`
/ `render_text`. The tool-call format itself (tags, `format_calls`, `parse_calls`) is
`models.tool_format`; the template renders calls exactly as `format_calls` writes them.

Exact-token property: an assistant message with plain content renders as the generation
prompt `<|im_start|>assistant\\n`, the content, then `<|im_end|>`, so prompt + sampled tokens
are a token prefix of the next turn's prompt.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from art_core.models.tool_format import END_OF_TURN, OPEN, parse_arguments

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
    if not text.startswith(head) or END_OF_TURN not in text:
        return ""
    return str(text[len(head) : text.index(END_OF_TURN)])


def ensure_tool_template(tokenizer: Any) -> None:
    """Install our tool template on `tokenizer` unless its own template already renders tools.

    A replaced ChatML template keeps its default system prompt (SmolLM2's "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face").
    """
    text = _probe_render(tokenizer)
    if text is not None and all(f"{_PROBE}_{s}" in text for s in ("tool", "argument", "result")):
        if OPEN not in text:
            logger.warning(
                "Keeping the model's own tool template, but it does not use <tool_call> blocks; "
                "parse_calls will not find tool calls in its completions."
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
                fn["arguments"] = parse_arguments(fn.get("arguments"))
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
