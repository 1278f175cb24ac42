"""The ChatML + Hermes tool template, its exact-token prefix property, and the tool-call parser."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from art_core.models.chat_template import (
    HERMES_TOOL_TEMPLATE,
    ensure_tool_template,
    hermes_tool_template,
    render_prompt,
    render_text,
)
from art_core.models.loading import LoadedModel
from art_core.models.tool_format import format_calls, parse_calls

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# SmolLM2-135M-Instruct's own template (from its GGUF metadata): ChatML, no tools.
SMOLLM2_ORIGINAL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "22°C"},
    {"role": "assistant", "content": "Paris: 18°C, sunny. Rome: 22°C."},
]

GOLDEN_TOOL_CONVERSATION = """\
<|im_start|>system
You are a weather bot.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Rome?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Rome"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18°C, sunny
</tool_response>
<tool_response>
22°C
</tool_response><|im_end|>
<|im_start|>assistant
Paris: 18°C, sunny. Rome: 22°C.<|im_end|>
"""


@pytest.fixture(params=["tiny", "smollm2"])
def tokenizer(
    request: pytest.FixtureRequest, tiny_model: LoadedModel, smollm2_tokenizer: PreTrainedTokenizerBase
) -> PreTrainedTokenizerBase:
    return tiny_model.tokenizer if request.param == "tiny" else smollm2_tokenizer


# ------------------------------------------------------------------------------------ rendering


def test_golden_tool_conversation(tokenizer: PreTrainedTokenizerBase) -> None:
    assert (
        render_text(tokenizer, CONVERSATION, TOOLS, add_generation_prompt=False) == GOLDEN_TOOL_CONVERSATION
    )
    ids = render_prompt(tokenizer, CONVERSATION, TOOLS, add_generation_prompt=False)
    assert tokenizer.decode(ids) == GOLDEN_TOOL_CONVERSATION


def test_golden_without_system_message(
    tiny_model: LoadedModel, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    assert (
        render_text(tiny_model.tokenizer, messages)
        == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_text(smollm2_tokenizer, messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = render_text(smollm2_tokenizer, messages, TOOLS)
    assert with_tools.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}\n\n# Tools\n\n")
    assert render_text(tiny_model.tokenizer, messages, TOOLS).startswith("<|im_start|>system\n# Tools\n\n")


def test_render_prompt_matches_hf_tokenization(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = render_prompt(tokenizer, messages, TOOLS)
    hf = tokenizer.apply_chat_template(
        messages, tools=[*TOOLS], add_generation_prompt=True, return_dict=False
    )
    assert ids == list(hf)
    assert all(isinstance(i, int) for i in ids)
    tail = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(tail) :] == tail


@pytest.mark.parametrize(
    "content",
    [
        "Paris.",
        "The capital of France is Paris.",
        "Sure!\n\n1. Red\n2. Blue",
        "42",
        "ok 🙂",
        "trailing space ",
    ],
)
def test_assistant_turn_extends_the_prompt_token_for_token(
    tokenizer: PreTrainedTokenizerBase, content: str
) -> None:
    # Holds for content that does not start with whitespace: a byte-level pre-tokenizer may merge leading
    # spaces with the "\n" of the generation prompt (the engine's sampled ids are exact either way).
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me something."},
    ]
    for tools in (None, TOOLS):
        prompt = render_prompt(tokenizer, history, tools)
        full = render_prompt(tokenizer, [*history, {"role": "assistant", "content": content}], tools)
        sampled = tokenizer.encode(content, add_special_tokens=False) + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]
        assert full[: len(prompt) + len(sampled)] == prompt + sampled
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


def test_assistant_tool_call_renders_as_format_calls(tokenizer: PreTrainedTokenizerBase) -> None:
    calls = CONVERSATION[2]["tool_calls"]
    history = CONVERSATION[:2]
    prompt = render_text(tokenizer, history, TOOLS)
    for content, body in (
        (None, format_calls(calls)),
        ("Let me check.", "Let me check.\n" + format_calls(calls)),
    ):
        turn = {"role": "assistant", "content": content, "tool_calls": calls}
        full = render_text(tokenizer, [*history, turn], TOOLS, add_generation_prompt=False)
        assert full == prompt + body + "<|im_end|>\n"


def test_message_normalisation(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_text(tok, parts) == render_text(tok, [{"role": "user", "content": "ab"}])
    as_dict: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"k": 1}}}]},
        {"role": "tool", "content": {"result": 2}},
    ]
    text = render_text(tok, as_dict, add_generation_prompt=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"k": 1}}\n</tool_call><|im_end|>' in text
    assert '<tool_response>\n{"result": 2}\n</tool_response>' in text


# ------------------------------------------------------------------------------------ parsing


def test_parse_round_trip() -> None:
    calls: list[dict[str, Any]] = [
        {"name": "get_weather", "arguments": '{"city": "Zürich", "units": ["C", "F"]}'},
        {"name": "search", "arguments": {"q": 'say "hi"', "n": 3, "nested": {"a": None}}},
    ]
    content, parsed = parse_calls(format_calls(calls))
    assert content is None
    assert [c["function"]["name"] for c in parsed] == ["get_weather", "search"]
    assert json.loads(parsed[0]["function"]["arguments"]) == {"city": "Zürich", "units": ["C", "F"]}
    assert json.loads(parsed[1]["function"]["arguments"]) == calls[1]["arguments"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed)
    assert len({c["id"] for c in parsed}) == 2
    assert format_calls(parsed) == format_calls(calls)


def test_parse_content_and_call() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_parse_compact_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name":"f","arguments":"{\\"a\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    content, calls = parse_calls(text)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"a": 1}'),
        ("g", "{}"),
    ]


def test_parse_malformed_blocks_stay_in_content() -> None:
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    bad_json = '<tool_call>\n{"name": "broken", "arguments": {\n</tool_call>'
    no_name = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    unclosed = '<tool_call>\n{"name": "cut", "argu'
    content, calls = parse_calls(f"{bad_json}\n{good}\n{no_name}\n{unclosed}")
    assert [c["function"]["name"] for c in calls] == ["ok"]
    assert content == f"{bad_json}\n\n{no_name}\n{unclosed}"


def test_parse_plain_text() -> None:
    assert parse_calls("  Paris.  ") == ("Paris.", [])
    assert parse_calls("") == (None, [])


# ------------------------------------------------------------------------------------ ensure_tool_template


def test_ensure_tool_template_replaces_smollm2_template(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = SMOLLM2_ORIGINAL_TEMPLATE
    ensure_tool_template(tok)
    assert tok.chat_template == hermes_tool_template(SMOLLM2_SYSTEM)
    assert smollm2_tokenizer.chat_template == hermes_tool_template(SMOLLM2_SYSTEM)  # what loading did


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_model: LoadedModel) -> None:
    from art_core.models.chat_template import UnsupportedModelError

    tok = copy.deepcopy(tiny_model.tokenizer)
    tok.chat_template = None
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        ensure_tool_template(tok)


def test_a_template_with_tools_in_an_unknown_format_is_refused(tiny_model: LoadedModel) -> None:
    from art_core.models.chat_template import UnsupportedModelError

    tok = copy.deepcopy(tiny_model.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
        "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
    )
    with pytest.raises(UnsupportedModelError, match="cannot parse"):
        ensure_tool_template(tok)


def test_ensure_tool_template_installs_ours_on_a_chatml_template_without_tools(
    tiny_model: LoadedModel,
) -> None:
    tok = copy.deepcopy(tiny_model.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    ensure_tool_template(tok)
    assert tok.chat_template == HERMES_TOOL_TEMPLATE


def test_ensure_tool_template_keeps_a_tool_capable_template(tiny_model: LoadedModel) -> None:
    tok = copy.deepcopy(tiny_model.tokenizer)
    own = "{# a model's own tool template #}\n" + hermes_tool_template("You are Qwen.")
    tok.chat_template = own
    ensure_tool_template(tok)
    assert tok.chat_template == own


def test_the_tool_format_is_one_set_of_tags_for_template_tokenizer_and_parser(
    tiny_model: LoadedModel, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    from art_core.models import tool_format

    added = tiny_model.tokenizer.get_added_vocab()
    assert all(tag in added for tag in tool_format.TAGS)  # the tiny tokenizer has them as single tokens
    assert tool_format.tag_ids(tiny_model.tokenizer) == (added[tool_format.OPEN], added[tool_format.CLOSE])
    assert tool_format.tag_ids(smollm2_tokenizer) is None  # SmolLM2 spells them in ordinary tokens
    assert tiny_model.tokenizer.eos_token == tool_format.END_OF_TURN
    text = format_calls([{"name": "f", "arguments": {"x": 1}}])
    assert text.startswith(tool_format.BLOCK_OPEN) and text.endswith(tool_format.BLOCK_CLOSE)
    rendered = render_text(
        smollm2_tokenizer,
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
        ],
        add_generation_prompt=False,
    )
    assert text + tool_format.END_OF_TURN in rendered
