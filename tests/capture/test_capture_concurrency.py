"""32 concurrent multi-turn tool-calling rollouts through one server never mix their records.

Each rollout has its own marker in every message it sends. The tiny random model cannot decide to
call a tool, so each conversation opens with a tool call and its result already in the history
(context, as a resumed agent would send it); then the model answers and the user follows up, for
2 or 3 sampled turns. One rollout raises after its first call: it is counted in its group's
`exceptions`, its records are freed, and every other trajectory is intact.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from art_core.backends import LocalBackend
from art_core.model import TrainableModel
from art_core.rollouts.groups import TrajectoryGroup, gather_trajectory_groups
from integrations import rollout_scope
from tests.helpers_serving import served_fixture

ASYNC = pytest.mark.asyncio(loop_scope="module")
GROUPS, PER_GROUP = 8, 4
FAILING = "g3r1"


served = served_fixture("concurrency", project="capture", name="crowd")


def opening(marker: str) -> list[dict[str, Any]]:
    call = {
        "id": f"call_{marker}",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"key": marker})},
    }
    return [
        {"role": "system", "content": f"You help user {marker}."},
        {"role": "user", "content": f"Look up {marker}."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{marker}", "content": f"value of {marker} is 42"},
    ]


class InFlight:
    """Counts requests in flight, to show that the rollouts really overlapped."""

    def __init__(self) -> None:
        self.now = self.most = 0

    async def call(self, awaitable: Any) -> Any:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            return await awaitable
        finally:
            self.now -= 1


@ASYNC
async def test_32_concurrent_tool_calling_rollouts_never_mix(
    served: tuple[LocalBackend, TrainableModel],
) -> None:
    backend, model = served
    client = model.openai_client()
    in_flight = InFlight()
    sent: dict[str, list[list[dict[str, Any]]]] = {}

    @rollout_scope(model)
    async def agent(marker: str, turns: int) -> float:
        messages = opening(marker)
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        for turn in range(turns):
            create = client.chat.completions.create(
                model=model.name, messages=messages, tools=tools, max_tokens=4
            )
            response = await in_flight.call(create)
            sent.setdefault(marker, []).append(list(messages))
            if marker == FAILING:
                raise RuntimeError(f"rollout {marker} broke mid-way")
            messages = [
                *messages,
                response.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"{marker} follow-up {turn}"},
            ]
            await asyncio.sleep(0)  # let other rollouts interleave between turns
        return float(len(marker))

    markers = [[f"g{g}r{r}" for r in range(PER_GROUP)] for g in range(GROUPS)]
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(agent(m, 2 + (i % 2)) for i, m in enumerate(row)) for row in markers),
        pbar=False,
        max_exceptions=1,
    )

    assert in_flight.most > 1, "the rollouts did not overlap"
    failed = [g for g in groups if g.exceptions]
    assert len(failed) == 1 and "g3r1 broke mid-way" in failed[0].exceptions[0].message
    assert sum(len(g.trajectories) for g in groups) == GROUPS * PER_GROUP - 1
    tokenizer = backend.service.get(model.name).loaded.tokenizer
    everyone = {m for row in markers for m in row}
    for row, group in zip(markers, groups, strict=True):
        for trajectory in group.trajectories:
            text = " ".join(str(m.get("content")) for m in trajectory.messages if m["role"] != "assistant")
            marker = text.split()[3].rstrip(".")  # "You help user <marker>."
            assert marker in row
            others = {m for m in everyone - {marker} if m in text.replace(marker, "")}
            assert not others, f"{marker}'s trajectory holds messages of {others}"
            expected_turns = 2 + row.index(marker) % 2
            assert len(trajectory.turns) == expected_turns and not trajectory.additional_histories
            assert trajectory.reward == float(len(marker))
            assert trajectory.messages[: len(sent[marker][-1])] == sent[marker][-1]
            assert trajectory.messages[2]["tool_calls"][0]["id"] == f"call_{marker}"
            assert trajectory.messages[3]["role"] == "tool"
            for turn in trajectory.turns:
                prompt = tokenizer.decode(turn.prompt_ids)
                assert f"value of {marker} is 42" in prompt
                assert not any(f"value of {m} is" in prompt for m in everyone - {marker})
    assert backend.recorder.stats() == {"rollouts": 0, "records": 0}
