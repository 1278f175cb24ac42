"""The chat template: ChatML with Hermes-style tool calls, and rendering OpenAI messages with it.

Holds `HERMES_TOOL_TEMPLATE` (for ChatML models whose own template cannot render tools, e.g.
SmolLM2), `ensure_tool_template` (which template and `ToolFormat` a tokenizer gets, by probe
renders; `tool_format_of` reads it back), `inline_tools` (tools written into plain messages for a
template with no tool support, e.g. Gemma 3's and Phi-3's) and `render_prompt` / `render_text`. The tool-call format itself (tags, `format_calls`, `parse_calls`) is
`models.tool_format`; the template renders calls exactly as `format_calls` writes them.

Exact-token property: an assistant message with plain content renders as the generation
prompt `<|im_start|>assistant\\n`, the content, then `<|im_end|>`, so prompt + sampled tokens
are a token prefix of the next turn's prompt.
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import Any

from art_core.models.tool_format import (
    END_OF_TURN,
    HERMES,
    MISTRAL_CALLS,
    OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    ToolFormat,
    format_calls,
    parse_arguments,
)

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
                "id": "callprobe",  # 9 alphanumerics: Mistral's template refuses other ids
                "type": "function",
                "function": {"name": f"{_PROBE}_tool", "arguments": {"q": f"{_PROBE}_argument"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "callprobe", "content": f"{_PROBE}_result"},
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


class UnsupportedModelError(ValueError):
    """A model our server cannot chat with (no chat template, or tools in a format we cannot parse);
    raised when the model is loaded, so registration fails, not the first request."""


_FORMATS: weakref.WeakKeyDictionary[Any, ToolFormat] = weakref.WeakKeyDictionary()
_REPLY = f"{_PROBE}_reply"


def _render_or_none(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str | None:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))
    except Exception as exc:  # any template error means: cannot render this
        logger.debug("chat template failed on a probe: %s", exc)
        return None


def _end_of_turn(tokenizer: Any) -> str:
    """The added token the template writes right after an assistant reply; else the eos token."""
    text = _render_or_none(
        tokenizer, [{"role": "user", "content": _PROBE}, {"role": "assistant", "content": _REPLY}]
    )
    if text is not None and _REPLY in text:
        after = text[text.index(_REPLY) + len(_REPLY) :]
        for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
            if token and after.startswith(token):
                return str(token)
    return str(tokenizer.eos_token or END_OF_TURN)


def _native_format(text: str, end_of_turn: str) -> ToolFormat | None:
    """The format of a probe conversation the model's own template rendered with tools."""
    if OPEN in text:
        return ToolFormat("hermes", end_of_turn)
    if MISTRAL_CALLS in text:
        return ToolFormat("mistral", end_of_turn)
    if f'"name": "{_PROBE}_tool", "parameters": ' in text:
        return ToolFormat("llama3_json", end_of_turn)
    return None


def ensure_tool_template(tokenizer: Any) -> ToolFormat:
    """Choose how `tokenizer` renders tools, and remember it (`tool_format_of`):

    - its own template renders tools in a format we parse (Hermes, Llama 3 JSON, Mistral): kept;
    - a ChatML template without tools (SmolLM2): replaced by ours, keeping its default system
      prompt ("You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    - another template without tools (Gemma 3, Phi-3): kept, with tools written into its plain
      messages (`inline_tools`).
    Raises `UnsupportedModelError` for a tokenizer with no chat template, or one that renders tools
    in a format we cannot parse.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError(
            "the model's tokenizer has no chat template, so it cannot serve chat completions or tool "
            "calls. Use an instruct/chat model, or set `tokenizer.chat_template` and save it with the model."
        )
    end = _end_of_turn(tokenizer)
    text = _probe_render(tokenizer)
    if text is not None and all(f"{_PROBE}_{s}" in text for s in ("tool", "argument", "result")):
        native = _native_format(text, end)
        if native is None:
            raise UnsupportedModelError(
                "the model's chat template renders tool calls in a format this server cannot parse "
                "(known: Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]). Replace "
                "`tokenizer.chat_template` with one in a known format."
            )
        return _remember(tokenizer, native)
    plain = _render_or_none(tokenizer, [{"role": "user", "content": _PROBE}], add_generation_prompt=True)
    if plain is None:
        raise UnsupportedModelError(
            "the model's chat template cannot render even one user message; fix `tokenizer.chat_template`."
        )
    if "<|im_start|>" in plain:
        default_system = _default_system_of(tokenizer)
        logger.info("Installing the Hermes tool chat template (default system prompt: %r)", default_system)
        tokenizer.chat_template = hermes_tool_template(default_system)
        return _remember(tokenizer, HERMES)
    logger.info("The chat template renders no tools: writing Hermes tool text into its messages")
    return _remember(tokenizer, ToolFormat("hermes", end, in_content=True))


def _remember(tokenizer: Any, fmt: ToolFormat) -> ToolFormat:
    _FORMATS[tokenizer] = fmt
    return fmt


def tool_format_of(tokenizer: Any) -> ToolFormat:
    """The tool format `ensure_tool_template` chose for `tokenizer` (chosen now if it never ran)."""
    fmt = _FORMATS.get(tokenizer)
    return fmt if fmt is not None else ensure_tool_template(tokenizer)


def _tools_text(tools: list[dict[str, Any]]) -> str:
    """The tool instructions of our Hermes template, as plain text."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>"
        "\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Normalized `messages` with tools written as Hermes text, for a template with no tool support:
    the tool list joins the system message, an assistant's calls become `<tool_call>` blocks of its
    content, and tool results become user turns of `<tool_response>` blocks (merged with adjacent
    user turns, so roles still alternate user/assistant as Gemma's template requires)."""
    out: list[dict[str, Any]] = []
    if tools:
        if messages and messages[0].get("role") == "system":
            system, messages = messages[0], messages[1:]
            text = f"{system.get('content') or ''}\n\n{_tools_text(tools)}".lstrip()
        else:
            text = _tools_text(tools)
        out.append({"role": "system", "content": text})
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = format_calls(message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1]["role"] == "user":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        elif role == "user" and out and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": role, "content": content})
    return out


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
        if not m.get("tool_calls"):
            m.pop("tool_calls", None)  # Llama 3's template tests `'tool_calls' in message`
        else:
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
    """The prompt text the tokenizer's chat template renders for OpenAI-style `messages` (with the
    tools written into the messages when its template has no tool support: `inline_tools`)."""
    normalized = normalize_messages(messages)
    if tool_format_of(tokenizer).in_content:
        normalized, tools = inline_tools(normalized, tools), None
    return str(
        tokenizer.apply_chat_template(
            normalized,
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
