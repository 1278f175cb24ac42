"""Inputs invented from a task description: generated in batches, de-duplicated, split, saved.

`generate_items` is the generic part (any item schema; MCP·RL uses it for its scenarios): each
batch is one structured-output call that is shown the items written so far (so batches differ)
and a different angle to vary them; invalid answers are retried (`autorl.structured`); exact and
near duplicates are dropped with rapidfuzz; too few distinct items raise `TooFewInputsError`.

`generate_inputs` adds what AutoRL needs: a system prompt for the task, input texts, ids (a hash
of the text, so a hand-edited file keeps its ids) and a deterministic train/validation split.
`save_inputs`/`load_inputs` write and read them as JSONL, one input per line
(`{"id", "split", "input"}`), beside a `<name>.meta.json` holding the task and system prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from art_core.atomic import atomic_write_bytes
from autorl.structured import Endpoint, StructuredOutputError, ask_structured, shape_hint

logger = logging.getLogger(__name__)

Split = Literal["train", "val"]

ANGLES = (
    "everyday situations",
    "work and business",
    "short, casual messages",
    "long, detailed messages",
    "unusual requests and edge cases",
    "messages with typos, slang or ambiguity",
    "technical or specialised topics",
    "personal and emotional topics",
)
"""One angle per batch, in turn, so that consecutive batches differ even for a weak generator."""

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "minLength": 3, "maxLength": 200}},
    "required": ["input"],
    "additionalProperties": False,
}
"""One AutoRL input: the first user message of a conversation."""

SYSTEM_PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"system_prompt": {"type": "string", "minLength": 10, "maxLength": 500}},
    "required": ["system_prompt"],
    "additionalProperties": False,
}


class TooFewInputsError(RuntimeError):
    """The generator could not produce enough distinct, valid items; the message says what to do."""


class InputFileError(ValueError):
    """An inputs JSONL file that cannot be read; the message names the line."""


@dataclass(frozen=True)
class InputItem:
    """One input of a task, with its id and split."""

    id: str
    """Stable id: a hash of the text (hand-written files may use their own)."""
    split: Split
    """"train" (rollouts and training) or "val" (the head-to-head evaluation only)."""
    text: str
    """The first user message."""


@dataclass(frozen=True)
class InputSet:
    """The inputs of a task and the system prompt the trained model sees."""

    task: str
    """The task description the inputs were generated for."""
    system_prompt: str | None
    """The system prompt of every rollout; None if a hand-written file did not give one."""
    items: tuple[InputItem, ...]
    """Every input, train and validation."""
    stats: dict[str, int] = field(default_factory=dict)
    """How generation went: requested, generated, duplicates, invalid_batches, and
    system_prompt_fallbacks (1 when the generator could not write the system prompt)."""

    @property
    def train(self) -> list[InputItem]:
        return [i for i in self.items if i.split == "train"]

    @property
    def val(self) -> list[InputItem]:
        return [i for i in self.items if i.split == "val"]


# -- pure helpers -------------------------------------------------------------------------------


def normalise(text: str) -> str:
    """Case-folded, punctuation-free, single-spaced text: what "exact duplicate" compares."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def dedupe(texts: Sequence[str], *, threshold: float = 90.0) -> list[int]:
    """Indices of the texts to keep: the first of each group of exact or near duplicates.

    Exact: equal after `normalise`. Near: rapidfuzz `ratio` or `token_sort_ratio` >= `threshold`
    (0-100) against any kept text (small edits and word order do not make a text new).
    """
    from rapidfuzz import fuzz, process

    if not 0 < threshold <= 100:
        raise ValueError(f"threshold must be in (0, 100], got {threshold}")
    kept: list[int] = []
    kept_norm: list[str] = []
    seen: set[str] = set()
    for i, text in enumerate(texts):
        norm = normalise(text)
        if not norm or norm in seen:
            continue
        if kept_norm and any(
            process.extractOne(norm, kept_norm, scorer=scorer, score_cutoff=threshold)
            for scorer in (fuzz.ratio, fuzz.token_sort_ratio)
        ):
            continue
        seen.add(norm)
        kept.append(i)
        kept_norm.append(norm)
    return kept


def input_id(text: str) -> str:
    """The id of an input: the first 12 hex digits of the sha256 of its text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def assign_splits(ids: Sequence[str], *, val_fraction: float = 0.25, seed: int = 0) -> dict[str, Split]:
    """A deterministic split: the ids whose seeded hash sorts first are validation; pure.

    Does not depend on the order of `ids`. With two or more ids, both splits get at least one.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if len(set(ids)) != len(ids):
        raise ValueError("assign_splits got duplicate ids")
    n_val = round(len(ids) * val_fraction)
    if len(ids) >= 2:
        n_val = min(max(n_val, 1), len(ids) - 1)
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    val = set(ranked[:n_val])
    return {i: ("val" if i in val else "train") for i in ids}


def batch_schema(item_schema: dict[str, Any], count: int) -> dict[str, Any]:
    """The schema of one batch answer: `{"items": [exactly count items]}`."""
    items = {"type": "array", "items": item_schema, "minItems": count, "maxItems": count}
    return {
        "type": "object",
        "properties": {"items": items},
        "required": ["items"],
        "additionalProperties": False,
    }


def batch_messages(
    instructions: str, count: int, written: Sequence[str], angle: str, item_schema: dict[str, Any]
) -> list[dict[str, Any]]:
    """The messages asking for one batch of `count` new items; pure."""
    shape = shape_hint(batch_schema(item_schema, count))
    system = f"{instructions.strip()}\n\nAnswer with one JSON object of this shape, and nothing else: {shape}"
    shown = "\n".join(f"- {t}" for t in written[-30:])
    user = f"Write {count} new items, each different from the others. This time focus on: {angle}."
    if shown:
        user += f"\nAlready written (do not repeat these or write near copies of them):\n{shown}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- generation ---------------------------------------------------------------------------------


async def generate_items(
    generator: Endpoint,
    *,
    instructions: str,
    item_schema: dict[str, Any],
    n: int,
    batch_size: int = 8,
    text_key: str = "input",
    min_items: int | None = None,
    max_batches: int | None = None,
    parallel: int = 1,
    threshold: float = 90.0,
    patience: int = 3,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Generate up to `n` distinct items matching `item_schema`; returns (items, stats).

    `instructions` says what the items are (the system prompt of each batch call); `text_key`
    names the field compared for duplicates. Batches run `parallel` at a time, each round shown
    the items kept so far and each batch its own angle (every batch asks for `batch_size` items;
    surplus distinct items are dropped). Stops once `n` distinct items exist, after `patience`
    rounds in a row that added no new item (the generator has run dry), or after `max_batches`
    calls (default: 6x the batches `n` needs, at least 8: a small generator repeats itself, but
    while its rounds still add items they are cheap). `on_batch(kept, n)` is called after each
    round. Raises TooFewInputsError below `min_items` (default `n`) items.
    """
    if n < 1 or batch_size < 1 or parallel < 1 or patience < 1:
        raise ValueError(
            f"n, batch_size, parallel and patience must be >= 1, got {n}, {batch_size}, {parallel}, {patience}"
        )
    min_items = n if min_items is None else min_items
    max_batches = max_batches or max(8, 6 * math.ceil(n / batch_size))
    items: list[dict[str, Any]] = []
    stats = {"requested": n, "generated": 0, "duplicates": 0, "invalid_batches": 0, "batches": 0}
    errors: list[str] = []
    stale = 0
    while len(items) < n and stats["batches"] < max_batches and stale < patience:
        calls = min(parallel, max_batches - stats["batches"])
        written = [str(i[text_key]) for i in items]
        requests = []
        for k in range(calls):
            count = batch_size
            angle = ANGLES[(stats["batches"] + k) % len(ANGLES)]
            messages = batch_messages(instructions, count, written, angle, item_schema)
            requests.append(
                ask_structured(generator, messages, batch_schema(item_schema, count), name="items")
            )
        stats["batches"] += calls
        new: list[dict[str, Any]] = []
        for answer in await asyncio.gather(*requests, return_exceptions=True):
            if isinstance(answer, StructuredOutputError):
                stats["invalid_batches"] += 1
                errors.append(str(answer))
                logger.warning("an input batch failed: %s", answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                new += [{**item, text_key: str(item[text_key]).strip()} for item in answer["items"]]
        stats["generated"] += len(new)
        pool = items + new
        kept = dedupe([str(i[text_key]) for i in pool], threshold=threshold)
        stats["duplicates"] += len(pool) - len(kept)
        stale = stale + 1 if len(kept) <= len(items) else 0
        items = [pool[k] for k in kept][:n]
        if on_batch is not None:
            on_batch(len(items), n)
    if len(items) < min_items:
        raise TooFewInputsError(_too_few_message(len(items), min_items, stats, errors))
    return items, stats


def _too_few_message(got: int, wanted: int, stats: dict[str, int], errors: list[str]) -> str:
    message = (
        f"only {got} distinct items of the {wanted} needed after {stats['batches']} generator calls "
        f"({stats['generated']} items generated, {stats['duplicates']} duplicates or near duplicates "
        f"removed, {stats['invalid_batches']} invalid answers). Use a stronger generator "
        "(--generator openai/gpt-4.1-mini, or --generator-base-url URL --generator NAME), ask for fewer "
        "(--num-inputs), or write the inputs yourself (--inputs FILE, one JSON object per line with an "
        '"input" field).'
    )
    if errors:
        message += f" Last generator error: {errors[-1][:300]}"
    return message


def input_instructions(task: str) -> str:
    """The generator's instructions for AutoRL inputs of `task`; pure."""
    return (
        "You write realistic example inputs for an AI assistant. Each input is the first message a real "
        "user sends to the assistant: diverse in topic, length, tone and difficulty, including edge cases. "
        "Write only the user's message, never the assistant's answer.\n"
        f"The assistant's task: {task.strip()}"
    )


async def generate_system_prompt(task: str, generator: Endpoint) -> str:
    """A system prompt for an assistant doing `task`, written by `generator`."""
    messages = [
        {
            "role": "system",
            "content": "You write clear, concise system prompts for AI assistants. Answer with JSON "
            '{"system_prompt": "..."} and nothing else.',
        },
        {"role": "user", "content": f"Write the system prompt of an assistant whose task is: {task.strip()}"},
    ]
    answer = await ask_structured(generator, messages, SYSTEM_PROMPT_SCHEMA, name="system_prompt")
    return str(answer["system_prompt"]).strip()


def fallback_system_prompt(task: str) -> str:
    """The system prompt used when the generator cannot write one: the task itself; pure."""
    return f"You are a helpful assistant. Your task: {task.strip()}"


async def write_system_prompt(task: str, generator: Endpoint) -> tuple[str, bool]:
    """The generator's system prompt for `task`, or the task-derived fallback; (prompt, fell_back).

    A system prompt is a convenience, not data: a weak generator (a small local model can loop on
    one string until `max_tokens`) should not end the run, so its failure is logged as a warning,
    counted in the input set's stats and reported, and the task description stands in.
    """
    try:
        return await generate_system_prompt(task, generator), False
    except StructuredOutputError as exc:
        logger.warning(
            "the generator could not write a system prompt (%s); using the task description instead. "
            "Pass --system-prompt to set one, or use a stronger --generator",
            str(exc)[:300],
        )
        return fallback_system_prompt(task), True


async def generate_inputs(
    task: str,
    n: int = 24,
    *,
    generator: Endpoint,
    batch_size: int = 4,
    parallel: int = 4,
    val_fraction: float = 0.25,
    seed: int = 0,
    system_prompt: str | None = None,
    min_inputs: int | None = None,
    threshold: float = 90.0,
    on_batch: Callable[[int, int], None] | None = None,
) -> InputSet:
    """A system prompt (unless given) and `n` distinct inputs for `task`, split train/validation.

    Raises TooFewInputsError when fewer than `min_inputs` (default `n`) distinct valid inputs
    could be generated. A system prompt the generator cannot write falls back to the task
    (`write_system_prompt`), counted in `stats["system_prompt_fallbacks"]`.
    """
    if not task.strip():
        raise ValueError("the task description is empty: describe the task in a sentence or two")
    if n < 2:
        raise ValueError(f"n must be >= 2 (at least one training and one validation input), got {n}")
    fell_back = False
    if system_prompt is None:
        system_prompt, fell_back = await write_system_prompt(task, generator)
    items, stats = await generate_items(
        generator,
        instructions=input_instructions(task),
        item_schema=INPUT_SCHEMA,
        n=n,
        batch_size=batch_size,
        parallel=parallel,
        min_items=min_inputs,
        threshold=threshold,
        on_batch=on_batch,
    )
    stats["system_prompt_fallbacks"] = int(fell_back)
    return make_input_set(task, system_prompt, [str(i["input"]) for i in items], val_fraction, seed, stats)


def make_input_set(
    task: str,
    system_prompt: str | None,
    texts: Sequence[str],
    val_fraction: float = 0.25,
    seed: int = 0,
    stats: dict[str, int] | None = None,
) -> InputSet:
    """An InputSet from distinct texts: ids by hash, the deterministic split."""
    ids = [input_id(t) for t in texts]
    splits = assign_splits(ids, val_fraction=val_fraction, seed=seed)
    items = tuple(InputItem(i, splits[i], t) for i, t in zip(ids, texts, strict=True))
    return InputSet(task, system_prompt, items, dict(stats or {}))


# -- files --------------------------------------------------------------------------------------


def meta_path(path: Path) -> Path:
    """The sidecar of an inputs file: `inputs.jsonl` -> `inputs.meta.json`."""
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save_inputs(path: Path | str, inputs: InputSet) -> Path:
    """Write `inputs` as JSONL (one `{"id", "split", "input"}` per line) and its meta sidecar, atomically."""
    path = Path(path)
    lines = [
        json.dumps({"id": i.id, "split": i.split, "input": i.text}, ensure_ascii=False) for i in inputs.items
    ]
    meta = {"task": inputs.task, "system_prompt": inputs.system_prompt, "stats": inputs.stats}
    _atomic_write(meta_path(path), json.dumps(meta, ensure_ascii=False, indent=1) + "\n")
    _atomic_write(path, "\n".join(lines) + "\n")
    return path


def _read_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise InputFileError(f"{path}:{number}: not JSON ({exc}); write one JSON object per line") from None
    if not isinstance(row, dict) or not isinstance(row.get("input"), str) or not row["input"].strip():
        raise InputFileError(
            f'{path}:{number}: each line needs a non-empty "input" string, got {line[:80]!r}'
        )
    if row.get("split") not in (None, "train", "val"):
        raise InputFileError(f'{path}:{number}: "split" must be "train" or "val", got {row["split"]!r}')
    if "id" in row and (not isinstance(row["id"], str) or not row["id"]):
        raise InputFileError(f'{path}:{number}: "id" must be a non-empty string')
    return row


def load_inputs(
    path: Path | str, *, task: str | None = None, val_fraction: float = 0.25, seed: int = 0
) -> InputSet:
    """Read an inputs JSONL file (and its meta sidecar, if any).

    Lines without an `id` get the hash of their text; if no line has a `split`, the split is
    assigned as `assign_splits` does (lines that have one keep it). Raises InputFileError for an
    unreadable file, a bad line, duplicate ids, or an empty training or validation split.
    """
    path = Path(path)
    if not path.is_file():
        raise InputFileError(
            f"inputs file {path} does not exist (write it with `autorl inputs TASK --out DIR`)"
        )
    rows = [
        _read_line(path, n, line)
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if line.strip()
    ]
    meta: dict[str, Any] = {}
    if meta_path(path).is_file():
        meta = json.loads(meta_path(path).read_text(encoding="utf-8"))
    ids = [row.get("id") or input_id(row["input"]) for row in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputFileError(f"{path}: id {dup!r} appears more than once (ids and texts must be unique)")
    assigned = assign_splits(ids, val_fraction=val_fraction, seed=seed) if len(ids) >= 2 else {}
    items = tuple(
        InputItem(i, row.get("split") or assigned.get(i, "train"), row["input"].strip())
        for i, row in zip(ids, rows, strict=True)
    )
    inputs = InputSet(
        task or meta.get("task") or "", meta.get("system_prompt"), items, meta.get("stats") or {}
    )
    if not inputs.train or not inputs.val:
        raise InputFileError(
            f"{path}: needs at least one train and one val input, has {len(inputs.train)} and {len(inputs.val)}"
        )
    return inputs


def with_system_prompt(inputs: InputSet, system_prompt: str) -> InputSet:
    """`inputs` with another system prompt."""
    return replace(inputs, system_prompt=system_prompt)


__all__ = [
    "INPUT_SCHEMA",
    "InputFileError",
    "InputItem",
    "InputSet",
    "TooFewInputsError",
    "assign_splits",
    "dedupe",
    "generate_inputs",
    "generate_items",
    "fallback_system_prompt",
    "generate_system_prompt",
    "input_id",
    "load_inputs",
    "make_input_set",
    "save_inputs",
    "write_system_prompt",
]
