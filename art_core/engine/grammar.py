"""Constrained decoding with llguidance: JSON-schema answers and forced tool calls.

A `Grammar` is compiled from an OpenAI `response_format` (`json_schema` or `json_object`) or a
`tool_choice` (`"required"` or a named function). During decoding each constrained row owns a
`RowConstraint`: before sampling it masks the row's logits to the tokens the grammar allows,
after sampling it consumes the chosen token, and it says when the grammar is complete (then
only end-of-turn is allowed). The log-probs the engine reports stay the model's raw ones: the
trainer scores the same tokens without the mask, so the two agree.

Why llguidance: it enforces numeric bounds and required fields (two other libraries did not) and
needs no other package; its masking cost is in docs/benchmarks.md ("Constrained decoding").
The tool-call syntax (Hermes tags, Llama 3 JSON, Mistral's marker) comes from `models.tool_format`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from art_core.models.tool_format import BLOCK_CLOSE, BLOCK_OPEN, CallPieces

_TOKENIZERS: dict[int, Any] = {}
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A response_format / tool_choice that cannot be compiled (shown to the client as a 400)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled-once llguidance grammar (its serialized form) and what it came from."""

    source: str
    """llguidance grammar text (JSON of the grammar, as `LLMatcher` takes it)."""
    description: str
    """A short human-readable origin, e.g. `json_schema 'scores'` or `tool_choice required`."""


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """The llguidance tokenizer for a HF fast tokenizer (built once per tokenizer; ~0.3 s)."""
    import llguidance.hf

    key = id(tokenizer)
    with _LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None:
            eos = tokenizer.eos_token_id  # the end-of-turn token (`models.loading.prepare_chat_tokenizer`)
            cached = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos))
            _TOKENIZERS[key] = cached
        return cached[1]


def _json_options() -> dict[str, Any]:
    # Compact separators: small models run on with free whitespace; this keeps answers short.
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict[str, Any], name: str = "response") -> Grammar:
    """A grammar for one JSON value valid under `schema`."""
    from llguidance import LLMatcher

    try:
        source = LLMatcher.grammar_from_json_schema(schema, defaults=_json_options())  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema for response_format {name!r}: {exc}") from exc
    return _validated(Grammar(source, f"json_schema {name!r}"))


def json_object_grammar() -> Grammar:
    """`response_format: {"type": "json_object"}`: any JSON object."""
    return json_schema_grammar({"type": "object"}, name="json_object")


def _function(entry: Any, what: str) -> dict[str, Any]:
    """`entry["function"]` of a tool or a tool_choice; GrammarError unless both are JSON objects."""
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict):
        raise GrammarError(
            f"{what} must look like {{'type': 'function', 'function': {{'name': ...}}}}, got {entry!r}"
        )
    return function


def _call_schema(tool: dict[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    function = _function(tool, "each tool")
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function.get("name")}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def tool_call_grammar(
    tools: list[dict[str, Any]],
    tool_choice: Any,
    *,
    tag_ids: tuple[int, int] | None = None,
    pieces: CallPieces | None = None,
) -> Grammar:
    """A grammar that forces one Hermes tool call: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.

    `tool_choice="required"` allows any of `tools`; `{"type": "function", "function": {"name": n}}`
    allows only `n`. Arguments must satisfy the tool's parameter schema. `tag_ids` are the token
    ids of `<tool_call>` and `</tool_call>` when the tokenizer has them as single added tokens
    (Qwen-style; `models.tool_format.tag_ids`); then the grammar names those tokens instead of
    spelling the text. `pieces` (`models.tool_format.call_pieces`) gives another format's syntax
    around the call's JSON (Llama 3's bare `{"name": ..., "parameters": ...}`, Mistral's
    `[TOOL_CALLS] [...]`); it replaces `tag_ids`.
    """
    if not tools:
        raise GrammarError("tool_choice requires a non-empty `tools` list")
    if tool_choice == "required":
        chosen = tools
        description = "tool_choice required"
    elif isinstance(tool_choice, dict) and _function(tool_choice, "a tool_choice object").get("name"):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if _function(t, "each tool").get("name") == name]
        if not chosen:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools given")
        description = f"tool_choice {name!r}"
    else:
        raise GrammarError(
            f"unsupported tool_choice {tool_choice!r}: use 'auto', 'none', 'required' or a function"
        )
    schemas = [_call_schema(t, pieces.arguments_key if pieces else "arguments") for t in chosen]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if pieces is not None:
        start = f"start: {' '.join([*map(_lark_piece, pieces.before), 'body', *map(_lark_piece, pieces.after)])}\n"
    elif tag_ids is None:
        start = f"start: {json.dumps(BLOCK_OPEN)} body {json.dumps(BLOCK_CLOSE)}\n"
    else:
        start = f'start: <[{tag_ids[0]}]> "\\n" body "\\n" <[{tag_ids[1]}]>\n'
    lark = start + f"body: %json{json.dumps(body)}\n"
    from llguidance import LLMatcher

    # The JSON inside a lark grammar takes its options from "x-guidance".
    lark = lark.replace("%json{", "%json{" + f'"x-guidance": {json.dumps(_json_options())}, ', 1)
    return _validated(Grammar(LLMatcher.grammar_from_lark(lark), description))


def _lark_piece(piece: str | int) -> str:
    """A lark term for one piece: a token by id (`<[id]>`) or a string literal."""
    return f"<[{piece}]>" if isinstance(piece, int) else json.dumps(piece)


def _validated(grammar: Grammar) -> Grammar:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar.source)
    if is_error:
        raise GrammarError(
            f"cannot compile {grammar.description}: {messages[0] if messages else 'unknown error'}"
        )
    return grammar


class RowConstraint:
    """One decoding row's grammar state: mask logits, consume tokens, report completion."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int) -> None:
        from llguidance import LLMatcher

        self.grammar = grammar
        self.vocab_size = vocab_size
        self._matcher = LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar.source, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"cannot compile {grammar.description}: {self._matcher.get_error()}")
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """Boolean mask [vocab_size] of the tokens the grammar allows next."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> self._shifts) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (`logits` is one row [V'])."""
        allowed = self.allowed()
        width = min(logits.shape[-1], allowed.shape[0])
        logits[..., :width].masked_fill_(~allowed[:width], float("-inf"))
        logits[..., width:] = float("-inf")

    def consume(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(
                f"token {token_id} violates {self.grammar.description}: {self._matcher.get_error()}"
            )

    @property
    def finished(self) -> bool:
        """True once the grammar is complete and stopped (only end-of-turn may follow)."""
        return bool(self._matcher.is_stopped())
