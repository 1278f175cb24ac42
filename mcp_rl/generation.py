"""Scenarios from tool descriptions: generate, drop tasks that name a tool, de-duplicate, split, check.

`generate_scenarios(catalog, n, generator)` asks the generator (any `autorl.JudgeConfig` endpoint:
a LiteLLM model, or an OpenAI-compatible URL such as our own server) for tasks in batches, showing
it the server's catalog (tools, resources, prompts) and the tasks it already wrote, with the
scenario JSON schema as `response_format`. Tasks that name a tool are dropped, near duplicates
too; it stops with `TooFewScenariosError` when it cannot reach `n` distinct tasks.

Thin adapter (the contract's `autorl.inputs` does not exist yet on branch `autorl`): the batching,
`dedupe` and `assign_splits` here follow the contract's shapes and should be replaced by
`autorl.inputs.generate_items` / `dedupe` / `assign_splits` once they land. The transport is
already autorl's (`autorl.judge.complete`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autorl.judge import JudgeConfig, as_judge_config, complete
from mcp_rl.catalog import ServerCatalog
from mcp_rl.scenarios import Check, Scenario, _number

logger = logging.getLogger(__name__)


class TooFewScenariosError(RuntimeError):
    """The generator did not produce enough distinct, valid tasks."""


INSTRUCTIONS = """\
You write test tasks for an AI agent that can use the tools of an MCP server, described below.
Write {n} new, realistic tasks a user of this server would ask for. Rules:
- each task must be achievable with these tools; mix one-call tasks with multi-step ones;
- never name a tool or mention tools; write what the user wants, in their words;
- give each a difficulty from 1 (one tool call) to 5 (many calls and reasoning);
- when the task has a short factual answer that you can know for certain from the descriptions \
below, put it in "expected"; otherwise leave "expected" empty.
Answer with JSON only: {{"scenarios": [{{"task": "...", "difficulty": 1, "expected": ""}}]}}

{catalog}
{avoid}"""


def scenario_schema(n: int) -> dict[str, Any]:
    """The JSON schema of one generator answer: `n` scenarios (task, difficulty 1-5, expected)."""
    item = {
        "type": "object",
        "properties": {
            "task": {"type": "string", "minLength": 8, "maxLength": 400},
            "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
            "expected": {"type": "string", "maxLength": 120},
        },
        "required": ["task", "difficulty", "expected"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"scenarios": {"type": "array", "items": item, "minItems": 1, "maxItems": n}},
        "required": ["scenarios"],
        "additionalProperties": False,
    }


def names_a_tool(task: str, tool_names: Sequence[str]) -> bool:
    """Whether the task names one of the tools (as written, or with `_`/`-` as spaces)."""
    text = task.casefold()
    for name in tool_names:
        forms = {name.casefold(), re.sub(r"[_-]+", " ", name.casefold())}
        if any(len(f) > 3 and re.search(rf"(?<![a-z0-9]){re.escape(f)}(?![a-z0-9])", text) for f in forms):
            return True
    return False


def dedupe(texts: Sequence[str], *, threshold: float = 0.9) -> list[int]:
    """Indices of the texts kept: exact duplicates (case and spacing ignored) and near duplicates
    (difflib ratio >= threshold with an earlier kept text) are dropped."""
    kept: list[int] = []
    normal = [" ".join(t.casefold().split()) for t in texts]
    for i, text in enumerate(normal):
        if all(
            text != normal[j] and difflib.SequenceMatcher(None, text, normal[j]).ratio() < threshold
            for j in kept
        ):
            kept.append(i)
    return kept


def assign_splits(ids: Sequence[str], *, val_fraction: float, seed: int = 0) -> dict[str, str]:
    """`train`/`val` per id, deterministic in (id, seed); at least one of each when there are >= 2 ids."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    n_val = min(max(1, round(len(ids) * val_fraction)), len(ids) - 1) if len(ids) >= 2 else 0
    val = set(ranked[:n_val])
    return {i: "val" if i in val else "train" for i in ids}


def _parse(text: str) -> list[dict[str, Any]]:
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        data = None
    items = data.get("scenarios") if isinstance(data, dict) else None
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _scenario(item: dict[str, Any], index: int) -> Scenario | None:
    task = item.get("task")
    difficulty = item.get("difficulty")
    if (
        not isinstance(task, str)
        or len(task.strip()) < 8
        or not isinstance(difficulty, int)
        or not 1 <= difficulty <= 5
    ):
        return None
    expected = item.get("expected")
    expected = expected.strip() if isinstance(expected, str) and expected.strip() else None
    check: Check = "number" if expected is not None and _number(expected) is not None else "contains"
    return Scenario(
        id=f"g{index:03d}", task=task.strip(), difficulty=difficulty, expected=expected, check=check
    )


async def generate_scenarios(
    catalog: ServerCatalog,
    n: int,
    generator: JudgeConfig | str,
    *,
    batch_size: int = 8,
    max_calls: int | None = None,
    val_fraction: float = 0.25,
    seed: int = 0,
    instructions: str = "",
) -> list[Scenario]:
    """`n` distinct scenarios from the catalog, split into train and val (see the module docstring)."""
    if n < 2:
        raise ValueError(f"need at least 2 scenarios (train and val), got {n}")
    config = as_judge_config(generator)
    config = replace(config, temperature=max(config.temperature, 1.0))
    found: list[Scenario] = []
    stats = {"calls": 0, "invalid": 0, "names_tool": 0, "duplicates": 0}
    limit = max_calls if max_calls is not None else 3 * (n // batch_size + 1)
    while len(found) < n and stats["calls"] < limit:
        want = min(batch_size, n - len(found))
        avoid = (
            "Already written (write different ones):\n" + "\n".join(f"- {s.task}" for s in found[-40:])
            if found
            else ""
        )
        prompt = INSTRUCTIONS.format(n=want, catalog=catalog.describe(), avoid=avoid) + (
            f"\n{instructions}" if instructions else ""
        )
        stats["calls"] += 1
        try:
            answer = await complete(config, [{"role": "user", "content": prompt}], scenario_schema(want))
        except Exception as exc:
            logger.warning("scenario generator call failed: %s", exc)
            continue
        for item in _parse(answer.text):
            scenario = _scenario(item, len(found) + 1)
            if scenario is None:
                stats["invalid"] += 1
            elif names_a_tool(scenario.task, catalog.tool_names):
                stats["names_tool"] += 1
            elif len(dedupe([*(s.task for s in found), scenario.task])) <= len(found):
                stats["duplicates"] += 1
            else:
                found.append(scenario)
    logger.info("scenario generation: %d kept of %s", len(found), stats)
    if len(found) < n:
        raise TooFewScenariosError(
            f"the generator {config.model} gave {len(found)} usable scenarios of the {n} asked for in "
            f"{stats['calls']} calls (dropped: {stats['invalid']} invalid, {stats['names_tool']} naming a tool, "
            f"{stats['duplicates']} duplicates); use a stronger --generator, ask for fewer, or write a "
            "--scenarios file by hand"
        )
    splits = assign_splits([s.id for s in found[:n]], val_fraction=val_fraction, seed=seed)
    return [replace(s, split=splits[s.id]) for s in found[:n]]  # type: ignore[arg-type]


__all__ = [
    "INSTRUCTIONS",
    "TooFewScenariosError",
    "assign_splits",
    "dedupe",
    "generate_scenarios",
    "names_a_tool",
    "scenario_schema",
]
