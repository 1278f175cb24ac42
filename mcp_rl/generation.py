"""Scenarios from tool descriptions: generate, drop tasks that name a tool, de-duplicate, split.

`generate_scenarios(catalog, n, generator)` asks the generator (any `autorl.JudgeConfig` endpoint:
a LiteLLM model, or an OpenAI-compatible URL such as our own server) for tasks through autorl's
batched `generate_items` (structured output, batches shown the tasks written so far, rapidfuzz
de-duplication, retries), with the server's catalog (tools, resources, prompts) in the
instructions and the scenario item schema (task, difficulty 1-5, expected answer). Tasks that
name a tool are dropped afterwards (a few more are asked for to make up for them); the split is
autorl's deterministic `assign_splits`. Too few usable tasks raise `TooFewScenariosError` (an
`autorl.TooFewInputsError`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autorl.inputs import TooFewInputsError, assign_splits, generate_items
from autorl.judge import JudgeConfig, as_judge_config
from mcp_rl.catalog import ServerCatalog
from mcp_rl.scenarios import Check, Scenario, _number

logger = logging.getLogger(__name__)


class TooFewScenariosError(TooFewInputsError):
    """The generator did not produce enough distinct, valid tasks."""


INSTRUCTIONS = """\
You write test tasks for an AI agent that can use the tools of an MCP server, described below.
Each item is one realistic task a user of this server would ask for. Rules:
- each task must be achievable with these tools; mix one-call tasks with multi-step ones;
- never name a tool or mention tools; write what the user wants, in their words;
- give each a difficulty from 1 (one tool call) to 5 (many calls and reasoning);
- when the task has a short factual answer that you can know for certain from the descriptions \
below, put it in "expected"; otherwise leave "expected" empty.

{catalog}"""

SCENARIO_ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task": {"type": "string", "minLength": 8, "maxLength": 400},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "expected": {"type": "string", "maxLength": 120},
    },
    "required": ["task", "difficulty", "expected"],
    "additionalProperties": False,
}
"""One generated scenario, as the generator writes it."""


def names_a_tool(task: str, tool_names: Sequence[str]) -> bool:
    """Whether the task names one of the tools (as written, or with `_`/`-` as spaces)."""
    text = task.casefold()
    for name in tool_names:
        forms = {name.casefold(), re.sub(r"[_-]+", " ", name.casefold())}
        if any(len(f) > 3 and re.search(rf"(?<![a-z0-9]){re.escape(f)}(?![a-z0-9])", text) for f in forms):
            return True
    return False


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
    text = INSTRUCTIONS.format(catalog=catalog.describe()) + (f"\n{instructions}" if instructions else "")
    try:
        items, stats = await generate_items(
            config, instructions=text, item_schema=SCENARIO_ITEM_SCHEMA, n=n + max(1, n // 4),
            batch_size=batch_size, text_key="task", min_items=n, max_batches=max_calls,
        )  # fmt: skip
    except TooFewInputsError as exc:
        raise TooFewScenariosError(f"{exc} (or write a --scenarios file by hand)") from exc
    found: list[Scenario] = []
    names_tool = invalid = 0
    for item in items:
        scenario = _scenario(item, len(found) + 1)
        if scenario is None:
            invalid += 1
        elif names_a_tool(scenario.task, catalog.tool_names):
            names_tool += 1
        else:
            found.append(scenario)
    logger.info(
        "scenario generation: %d kept (%d name a tool, %d invalid) of %s",
        len(found),
        names_tool,
        invalid,
        stats,
    )
    if len(found) < n:
        raise TooFewScenariosError(
            f"the generator {config.model} gave {len(found)} usable scenarios of the {n} asked for in "
            f"{stats['batches']} calls (dropped: {invalid} invalid, {names_tool} naming a tool, "
            f"{stats['duplicates']} duplicates); use a stronger --generator, ask for fewer, or write a "
            "--scenarios file by hand"
        )
    splits = assign_splits([s.id for s in found[:n]], val_fraction=val_fraction, seed=seed)
    return [replace(s, split=splits[s.id]) for s in found[:n]]


__all__ = [
    "INSTRUCTIONS",
    "TooFewScenariosError",
    "generate_scenarios",
    "names_a_tool",
    "SCENARIO_ITEM_SCHEMA",
]
