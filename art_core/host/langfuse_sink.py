"""The Langfuse sink: one trace per rollout, its LLM calls and tool calls as observations, the reward a score.

Each step's trajectories are exported when the step is recorded (the reward is final then: RULER
and other scorers run between the rollout and `train`/`log`). A trajectory's trace id is its
`metadata["rollout_id"]` when a rollout scope captured it (32 hex digits, a valid OTel trace id),
else one derived from project, model, step and position. Inside the trace's root span
(`rollout`, with the step, split and group as metadata):
- one generation per sampled turn (`llm`): the served model, `usage_details` input/output tokens
  (prompt and completion ids), the messages it answered and the assistant message it returned, and
  its latency (`Turn.seconds`, recorded by the server for captured rollouts) as the span's duration;
- one tool observation per tool call (`tool <name>`): from the MCP door's log lines
  (`art_core.capture.tool_log`: arguments, result or error, latency), else from the assistant's
  `tool_calls` and the tool messages answering them;
- a `reward` score on the trace (NUMERIC), with the judge's explanation (the logs) as its comment.

The Langfuse SDK (v3+, OTel-based) exports spans as OTLP/HTTP to `{host}/api/public/otel/v1/traces`
and scores through its ingestion API; it reads `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY` and
`LANGFUSE_HOST`. The sink flushes at the end of every step. Known limit: the public SDK starts a
span at the time it is created, so observations carry the recorded durations but export-time start
times.
"""

from __future__ import annotations

import re
import time
from typing import Any

from art_core.capture.tool_log import tool_calls_from_logs
from art_core.host.step_sink import StepRecord
from art_core.rollouts.records import Trajectory

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


def trace_id(client: Any, step: StepRecord, group: int, index: int, trajectory: Trajectory) -> str:
    """The rollout id where it is a valid trace id, else a stable one seeded by the trajectory's place."""
    rollout = str(trajectory.metadata.get("rollout_id") or "")
    if _TRACE_ID.match(rollout):
        return rollout
    seed = f"{step.project}/{step.model}/{step.split}/{step.step}/{group}/{index}"
    return str(client.create_trace_id(seed=seed))


def _end(observation: Any, seconds: float | None) -> None:
    """End `observation` `seconds` after now (its duration), or now when unknown."""
    observation.end(end_time=time.time_ns() + int(seconds * 1e9) if seconds else None)


def tool_observations(trajectory: Trajectory) -> list[dict[str, Any]]:
    """Tool calls of a trajectory: name, input, output, error, seconds (see the module docstring)."""
    logged = tool_calls_from_logs(trajectory.logs)
    if logged:
        return logged
    answers = {
        m.get("tool_call_id"): m.get("content") for m in trajectory.messages if m.get("role") == "tool"
    }
    found = []
    for message in trajectory.messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            found.append(
                {
                    "name": function.get("name"),
                    "arguments": function.get("arguments"),
                    "result": answers.get(call.get("id")),
                    "error": None,
                    "seconds": None,
                }
            )
    return found


def _export(client: Any, step: StepRecord, group: int, index: int, trajectory: Trajectory) -> None:
    trace = trace_id(client, step, group, index, trajectory)
    messages = list(trajectory.messages)
    root = client.start_observation(
        trace_context={"trace_id": trace},
        name="rollout",
        input=messages[:1],
        output=messages[-1:] if messages else None,
        metadata={
            "project": step.project,
            "model": step.model,
            "step": step.step,
            "split": step.split,
            "group": group,
        },
    )
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for number, turn in enumerate(trajectory.turns):
        at = assistant[number] if number < len(assistant) else None
        generation = root.start_observation(
            name="llm",
            as_type="generation",
            model=turn.model or step.model,
            input=messages[:at] if at is not None else None,
            output=messages[at] if at is not None else None,
            usage_details={"input": len(turn.prompt_ids), "output": len(turn.completion_ids)},
            metadata={"finish_reason": turn.finish_reason, "latency_s": turn.seconds},
        )
        _end(generation, turn.seconds)
    for call in tool_observations(trajectory):
        tool = root.start_observation(
            name=f"tool {call['name']}",
            as_type="tool",
            input=call["arguments"],
            output=call["result"] if call["error"] is None else call["error"],
            level="ERROR" if call["error"] is not None else None,
            metadata={"latency_s": call["seconds"]},
        )
        _end(tool, call["seconds"])
    root.end()
    if trajectory.reward is not None:
        client.create_score(
            name="reward",
            value=float(trajectory.reward),
            trace_id=trace,
            data_type="NUMERIC",
            comment="\n".join(trajectory.logs)[-2000:] or None,
        )


class LangfuseSink:
    """Exports each step's trajectories as Langfuse traces (client made on the first step)."""

    name = "langfuse"

    def __init__(self) -> None:
        self._client: Any = None

    def _started(self) -> Any:
        if self._client is None:
            from langfuse import Langfuse

            self._client = Langfuse()
        return self._client

    def record(self, step: StepRecord) -> None:
        client = self._started()
        for group, trajectories in enumerate(step.groups):
            for index, trajectory in enumerate(trajectories.trajectories):
                _export(client, step, group, index, trajectory)
        client.flush()

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.shutdown()
