"""AutoRL inputs: structured output (retries, the JSON-mode ladder), generation in batches,
de-duplication, the split, the JSONL files; against a scripted generator for the failure modes
and against our real server (tiny model) through the real openai and litellm clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from art_core.model import TrainableModel
from autorl.inputs import (
    INPUT_SCHEMA,
    InputFileError,
    TooFewInputsError,
    assign_splits,
    dedupe,
    fallback_system_prompt,
    generate_inputs,
    generate_items,
    load_inputs,
    make_input_set,
    save_inputs,
)
from autorl.judge import JudgeConfig
from autorl.structured import StructuredOutputError, ask_structured, forget_modes
from tests.helpers_scripted import Reply, ScriptedLLM, scripted_server
from tests.helpers_serving import served_fixture

served = served_fixture("autorl-inputs", project="autorl-inputs", name="agent")

TASK = "Rewrite the user's sentence in formal English."
ITEM_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def batch(*texts: str) -> str:
    return json.dumps({"items": [{"input": t} for t in texts]})


@pytest.fixture
def scripted_generator() -> Iterator[ScriptedLLM]:
    forget_modes()
    with scripted_server("generator") as llm:
        yield llm


@pytest.fixture(params=["openai", "litellm"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- pure parts ---------------------------------------------------------------------------------


def test_dedupe_drops_exact_and_near_duplicates_keeping_the_first() -> None:
    texts = [
        "Can you fix my email to the landlord?",
        "can you fix my email to the landlord",  # exact after normalising case and punctuation
        "Can you fix my e-mail to the landlord?",  # near
        "landlord the to email my fix you can?",  # same words, other order
        "Please turn this into a formal complaint about a late delivery.",
        "",
    ]
    assert dedupe(texts) == [0, 4]
    assert dedupe(texts, threshold=100) == [0, 2, 4]  # reordered words still score 100


def test_assign_splits_is_deterministic_order_free_and_never_empty() -> None:
    ids = [f"id{i}" for i in range(20)]
    first = assign_splits(ids, val_fraction=0.25, seed=3)
    assert first == assign_splits(list(reversed(ids)), val_fraction=0.25, seed=3)
    assert sum(s == "val" for s in first.values()) == 5
    assert first != assign_splits(ids, val_fraction=0.25, seed=4)
    assert sorted(assign_splits(["a", "b"], val_fraction=0.01).values()) == ["train", "val"]
    with pytest.raises(ValueError, match="val_fraction"):
        assign_splits(ids, val_fraction=1.0)


def test_inputs_round_trip_through_jsonl_and_hand_edits(tmp_path: Path) -> None:
    inputs = make_input_set(TASK, "Be formal.", ["one input", "another input", "a third input", "a fourth"])
    path = save_inputs(tmp_path / "inputs.jsonl", inputs)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(line) for line in lines] == [{"id", "split", "input"}] * 4
    assert load_inputs(path) == inputs
    # A hand-written file: no ids, no splits, no meta; ids are hashes and the split is assigned.
    hand = tmp_path / "mine.jsonl"
    hand.write_text('{"input": "first"}\n\n{"input": "second", "split": "val"}\n{"input": "third"}\n')
    loaded = load_inputs(hand, task=TASK)
    assert loaded.system_prompt is None and loaded.task == TASK
    assert [i.text for i in loaded.items] == ["first", "second", "third"] and loaded.val


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"input": "a"}\nnot json\n', "mine.jsonl:2: not JSON"),
        ('{"text": "a"}\n', 'needs a non-empty "input"'),
        ('{"input": "a", "split": "test"}\n', '"split" must be "train" or "val"'),
        ('{"input": "a", "id": "x"}\n{"input": "b", "id": "x"}\n', "id 'x' appears more than once"),
        (
            '{"input": "a", "split": "train"}\n{"input": "b", "split": "train"}\n',
            "at least one train and one val",
        ),
    ],
)
def test_load_inputs_names_the_bad_line(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(text)
    with pytest.raises(InputFileError, match=reason.replace("(", r"\(")):
        load_inputs(path)


# -- scripted generator: failure modes ----------------------------------------------------------


async def test_invalid_output_is_retried_with_the_reason(
    scripted_generator: ScriptedLLM, transport: str
) -> None:
    scripted_generator.script("Sure! Here you go: none", '{"answer": 3}', '```json\n{"answer": "ok"}\n```')
    value = await ask_structured(
        scripted_generator.config(transport), [{"role": "user", "content": "hi"}], ITEM_SCHEMA
    )
    assert value == {"answer": "ok"}
    second, third = scripted_generator.requests[1], scripted_generator.requests[2]
    assert "no JSON object in the answer" in second["messages"][-1]["content"]
    assert "answer: 3 is not of type 'string'" in third["messages"][-1]["content"]
    assert second["response_format"]["type"] == "json_schema"


async def test_invalid_output_every_time_raises_a_typed_error(
    scripted_generator: ScriptedLLM, transport: str
) -> None:
    scripted_generator.script("no", "still no", "{}")
    with pytest.raises(StructuredOutputError, match="gave no valid response in 3 attempt") as err:
        await ask_structured(
            scripted_generator.config(transport), [{"role": "user", "content": "hi"}], ITEM_SCHEMA
        )
    assert len(err.value.attempts) == 3 and "'answer' is a required property" in str(err.value)


async def test_json_mode_fallback_when_json_schema_is_rejected(
    scripted_generator: ScriptedLLM, transport: str
) -> None:
    scripted_generator.rejected_formats = {"json_schema"}
    scripted_generator.script('{"answer": "a"}', '{"answer": "b"}')
    config = scripted_generator.config(transport)
    assert await ask_structured(config, [{"role": "user", "content": "1"}], ITEM_SCHEMA) == {"answer": "a"}
    assert await ask_structured(config, [{"role": "user", "content": "2"}], ITEM_SCHEMA) == {"answer": "b"}
    kinds = [(r.get("response_format") or {}).get("type") for r in scripted_generator.requests]
    assert kinds == ["json_schema", "json_object", "json_object"]  # remembered after the first 400


async def test_no_response_format_when_json_mode_is_rejected_too(scripted_generator: ScriptedLLM) -> None:
    scripted_generator.rejected_formats = {"json_schema", "json_object"}
    scripted_generator.script('Here: {"answer": "a"}')
    assert await ask_structured(
        scripted_generator.config(), [{"role": "user", "content": "1"}], ITEM_SCHEMA
    ) == {"answer": "a"}
    assert [r.get("response_format") is None for r in scripted_generator.requests] == [False, False, True]


async def test_duplicates_are_removed_and_batches_see_earlier_items(scripted_generator: ScriptedLLM) -> None:
    scripted_generator.script(
        batch("Fix my note to the boss.", "fix my note to the boss", "Make this formal: gonna be late."),
        batch("Fix my note to the boss!", "Rewrite: hey guys, meeting moved.", "Formalise: thx for the gift"),
    )
    items, stats = await generate_items(
        scripted_generator.config(), instructions="Write inputs.", item_schema=INPUT_SCHEMA, n=4, batch_size=3
    )
    assert [i["input"] for i in items] == [
        "Fix my note to the boss.",
        "Make this formal: gonna be late.",
        "Rewrite: hey guys, meeting moved.",
        "Formalise: thx for the gift",
    ]
    assert stats["duplicates"] == 2 and stats["batches"] == 2
    second_prompt = scripted_generator.requests[1]["messages"][-1]["content"]
    assert "Already written" in second_prompt and "- Make this formal: gonna be late." in second_prompt
    assert (
        scripted_generator.requests[0]["response_format"]["json_schema"]["schema"]["properties"]["items"][
            "minItems"
        ]
        == 3
    )


async def test_too_few_distinct_inputs_is_a_clear_error(scripted_generator: ScriptedLLM) -> None:
    scripted_generator.responder = lambda body: batch("The same input.", "the same input!")
    with pytest.raises(
        TooFewInputsError, match=r"only 1 distinct items of the 6 needed after 4 generator calls"
    ) as err:
        await generate_inputs(
            TASK,
            6,
            generator=scripted_generator.config(),
            system_prompt="Be formal.",
            batch_size=2,
            parallel=1,
        )
    assert "--inputs FILE" in str(err.value) and "stronger generator" in str(err.value)


async def test_a_slow_but_steady_generator_gets_the_calls_it_needs(scripted_generator: ScriptedLLM) -> None:
    # One new item every third call: 13 calls for 6 items, past a fixed 3x budget (9 calls), and
    # never three rounds in a row without a new item.
    words = iter(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"])
    calls = iter(range(100))
    scripted_generator.responder = lambda body: (
        batch(f"{next(words)} is a new sentence here", "The same input.")
        if next(calls) % 3 == 0
        else batch("The same input.", "the same input!")
    )
    items, stats = await generate_items(
        scripted_generator.config(cache=False), instructions="x", item_schema=INPUT_SCHEMA, n=6, batch_size=2
    )
    assert len(items) == 6 and stats["batches"] == 13


async def test_a_failing_batch_is_counted_and_the_others_kept(scripted_generator: ScriptedLLM) -> None:
    scripted_generator.script(
        Reply(status=500), Reply(status=500), Reply(status=500), batch("alpha one", "beta two")
    )
    items, stats = await generate_items(
        scripted_generator.config(max_attempts=3),
        instructions="x",
        item_schema=INPUT_SCHEMA,
        n=2,
        batch_size=2,
    )
    assert stats["invalid_batches"] == 1 and len(items) == 2


async def test_a_system_prompt_the_generator_cannot_write_falls_back_to_the_task(
    scripted_generator: ScriptedLLM, caplog: pytest.LogCaptureFixture
) -> None:
    # A small local generator can loop inside the string until max_tokens: three cut-off answers.
    cut_off = '{"system_prompt": "Banana ' + "🍵" * 50
    scripted_generator.script(cut_off, cut_off, cut_off, batch("alpha one", "beta two", "gamma three"))
    with caplog.at_level("WARNING", logger="autorl.inputs"):
        found = await generate_inputs(
            TASK, 3, generator=scripted_generator.config(max_attempts=3), batch_size=3, parallel=1
        )
    assert found.system_prompt == fallback_system_prompt(TASK) and TASK in found.system_prompt
    assert found.stats["system_prompt_fallbacks"] == 1 and len(found.items) == 3
    assert "could not write a system prompt" in caplog.text and "--system-prompt" in caplog.text
    assert len(scripted_generator.requests) == 4


# -- the real thing: our server and the tiny model ----------------------------------------------


def own_generator(model: TrainableModel, transport: str) -> JudgeConfig:
    if transport == "openai":
        return JudgeConfig(
            model=f"{model.name}@0", base_url=model.inference_base_url, api_key=model.inference_api_key,
            temperature=1.0, max_tokens=400, cache=False,
        )  # fmt: skip
    extra = {"api_base": model.inference_base_url, "api_key": model.inference_api_key}
    return JudgeConfig(
        model=f"openai/{model.name}@0", extra_params=extra, temperature=1.0, max_tokens=400, cache=False
    )


async def test_generate_inputs_on_our_server(model: TrainableModel, transport: str, tmp_path: Path) -> None:
    forget_modes()
    found = await generate_inputs(
        TASK, 6, generator=own_generator(model, transport), batch_size=3, parallel=2
    )
    assert len(found.items) == 6 and found.system_prompt
    assert len(dedupe([i.text for i in found.items])) == 6
    assert {i.split for i in found.items} == {"train", "val"}
    path = save_inputs(tmp_path / "inputs.jsonl", found)
    assert load_inputs(path) == found


def test_import_is_lazy() -> None:
    import subprocess
    import sys

    code = "import autorl, sys; print('litellm' in sys.modules, 'torch' in sys.modules, 'autorl.pipeline' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]
