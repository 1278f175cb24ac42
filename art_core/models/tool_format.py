"""The tool-call formats, in one place: their tags, and turning calls into text and back.

Three formats (`ToolFormat.name`), each as the family's official chat template writes a call:
- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM2 with our template): `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole reply is `{"name": ..., "parameters": ...}`;
- `mistral` (Mistral v0.3 and later): `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`, call ids of 9
  alphanumerics (the template refuses any other).
A model whose template renders no tools at all (Gemma 3, Phi-3) gets `hermes` with `in_content`:
tools, calls and results are written as Hermes text into plain system/user/assistant messages,
which its own template then renders in its own turns (`models.chat_template.inline_tools`).

The Hermes specifics:

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


def _tool_call_from_json(body: str | Any, *, id_length: int = 0) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON of one call (text or already decoded), or None when it is
    not a valid call. `id_length`: a plain alphanumeric id of that length (Mistral's), else `call_...`."""
    try:
        obj = json.loads(body) if isinstance(body, str) else body
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
        "id": uuid.uuid4().hex[:id_length] if id_length else f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def parse_calls(text: str, fmt: ToolFormat | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split completion text into (content without the valid tool calls or None, OpenAI tool calls),
    in `fmt` (default: Hermes).

    Calls whose JSON is malformed, or that lack a name, stay in the content; no exception is raised.
    """
    if fmt is not None and fmt.name == "llama3_json":
        return _parse_llama3(text)
    if fmt is not None and fmt.name == "mistral":
        return _parse_mistral(text)
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


# ---------------------------------------------------------------------------------------- formats

FormatName = Literal["hermes", "llama3_json", "mistral"]
LLAMA3_PYTHON_TAG = "<|python_tag|>"
"""What Llama 3.1 may write before a call (ipython mode); dropped when parsing."""
MISTRAL_CALLS = "[TOOL_CALLS]"
"""Mistral's call marker, a special token of its tokenizer, followed by a JSON list of calls."""
MISTRAL_ID_LENGTH = 9
"""Mistral's template refuses tool call ids that are not 9 alphanumerics."""


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls, and how its turns end (found from its chat template)."""

    name: FormatName
    """The call syntax (see the module docstring)."""
    end_of_turn: str
    """The token that ends an assistant turn in its template (`<|im_end|>`, `<|eot_id|>`, `</s>`...)."""
    in_content: bool = False
    """True when the model's template renders no tools: ours are written into its plain messages."""

    def __post_init__(self) -> None:
        if self.name not in ("hermes", "llama3_json", "mistral"):
            raise ValueError(f"unknown tool format {self.name!r}: use hermes, llama3_json or mistral")
        if self.in_content and self.name != "hermes":
            raise ValueError("in_content writes Hermes blocks: it needs name='hermes'")

    @property
    def call_start(self) -> str:
        """Text that may begin a call: streamed content stops where it appears."""
        return {"hermes": OPEN, "llama3_json": "{", "mistral": MISTRAL_CALLS}[self.name]

    @property
    def arguments_key(self) -> str:
        """The key the arguments travel under: Llama 3 writes "parameters"."""
        return "parameters" if self.name == "llama3_json" else "arguments"


HERMES = ToolFormat("hermes", END_OF_TURN)
"""The Hermes format with ChatML turns (our template, Qwen's)."""


@dataclass(frozen=True)
class CallPieces:
    """What surrounds the JSON of one forced call, for the grammar: each piece is text, or the id
    of a token the tokenizer has as an added token (so the grammar names the token, never spells it)."""

    before: tuple[str | int, ...]
    after: tuple[str | int, ...]
    arguments_key: str


def call_pieces(fmt: ToolFormat, added_vocab: Mapping[str, int]) -> CallPieces:
    """The pieces around one call in `fmt`, with its tags as token ids where `added_vocab` has them."""

    def piece(text: str) -> str | int:
        return int(added_vocab[text]) if text in added_vocab else text

    if fmt.name == "llama3_json":
        return CallPieces((), (), fmt.arguments_key)
    if fmt.name == "mistral":
        return CallPieces((piece(MISTRAL_CALLS), " ["), ("]",), fmt.arguments_key)
    return CallPieces((piece(OPEN), "\n"), ("\n", piece(CLOSE)), fmt.arguments_key)


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3's JSON call: the whole reply (after an optional `<|python_tag|>`) is one call object."""
    body = text.strip()
    body = body.removeprefix(LLAMA3_PYTHON_TAG).strip()
    call = _tool_call_from_json(body) if body.startswith("{") else None
    if call is None:
        return (text.strip() or None), []
    return None, [call]


def _parse_mistral(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral's `[TOOL_CALLS] [{...}, ...]`: the content before the marker, the calls of the list."""
    marker = text.find(MISTRAL_CALLS)
    if marker < 0:
        return (text.strip() or None), []
    rest = text[marker + len(MISTRAL_CALLS) :].lstrip()
    try:
        items, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return (text.strip() or None), []
    items = items if isinstance(items, list) else [items]
    calls = [_tool_call_from_json(item, id_length=MISTRAL_ID_LENGTH) for item in items]
    if not calls or any(call is None for call in calls):
        return (text.strip() or None), []
    content = (text[:marker] + rest[end:]).strip()
    return (content or None), [call for call in calls if call is not None]


__all__ = [
    "BLOCK_CLOSE",
    "BLOCK_OPEN",
    "CLOSE",
    "HERMES",
    "CallPieces",
    "ToolFormat",
    "call_pieces",
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
