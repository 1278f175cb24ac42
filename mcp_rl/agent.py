"""The agent loop: the trained model uses the server's tools over several turns, then `complete_task`.

One rollout (`run_agent`) runs inside a rollout scope, so every chat completion reaches our server
under the rollout's id and the trajectory holds the exact tokens (the shared capture mechanism);
tool calls go through the MCP door (`integrations.mcp`), so they are in the trajectory's logs and
per-tool metrics, and their results are tool messages of the same conversation. The final tool
message (after `complete_task`) is appended to the captured conversation.

Each turn is one chat completion with the server's tools plus `complete_task`. With
`tool_choice="required"` (the default) our server constrains decoding to one valid tool call per
turn, so a small model always acts instead of chatting; "auto" lets it answer in prose, which is
then followed by a reminder to use the tools.

A conversation that outgrows the model's context window (say, a tool returned a long result) ends
the rollout there, as running out of turns does: the turns so far are a real trajectory of the
policy, scored as unfinished (`context_exhausted`), not a rollout lost to an exception. Only a first
turn that does not fit raises: then nothing was sampled, and every rollout of the scenario would fail.

Trajectory metrics: `turns`, `task_completed`, `ran_out_of_turns`, `context_exhausted`,
`server_failure`, `tool_calls`, `tool_errors` and per-tool counts (from the door); metadata:
`scenario_id`, `answer`, `failure`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import openai

from art_core.capture import message_key
from art_core.model import TrainableModel
from art_core.rollouts import CONTEXT_LENGTH_EXCEEDED
from art_core.types import Trajectory
from integrations.scope import RolloutScope, rollout
from mcp_rl.catalog import COMPLETE_TASK, ServerCatalog
from mcp_rl.connection import ServerConnection
from mcp_rl.scenarios import Scenario
from mcp_rl.servers import ServerPool
from mcp_rl.toolbox import ServerFailure, ToolCallConfig, call_tool, parse_arguments

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = """\
You are an agent that completes tasks with the tools of the server "{server}".
Look the facts up with the tools; never guess them. Then call complete_task with your final answer, \
giving the values the tools returned. You have at most {max_turns} turns."""

NUDGE = "Use a tool, or call complete_task with your final answer."
"""The user message after a reply without a tool call (tool_choice "auto" only)."""


@dataclass(frozen=True)
class AgentConfig:
    """How the agent runs."""

    max_turns: int = 3
    """Chat completions per rollout (`--max-turns`); the rollout ends after the last one. 3 fits a
    look-up, an action and complete_task, and keeps SmolLM2 on CPU inside the time budget."""
    max_tokens: int = 64
    """Tokens per turn (one constrained tool call; see `max_string_chars`)."""
    temperature: float = 1.0
    """Sampling temperature (1.0 while training: the logprobs are those of the sampled policy)."""
    tool_choice: str = "required"
    """`required`: every turn is exactly one tool call (constrained decoding on our server); `auto`:
    the model may answer in prose; a tool's name: every turn calls that tool (for probes and tests)."""
    system_prompt: str = SYSTEM_PROMPT
    """`{server}` and `{max_turns}` are filled in."""
    max_string_chars: int | None = 100
    """`maxLength` given to string arguments that have none, in the tools offered to the model, so a
    constrained tool call always closes within `max_tokens` (None: schemas as the server gave them)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.max_tokens < 8:
            raise ValueError(f"max_tokens must be >= 8, got {self.max_tokens}")
        if self.max_string_chars is not None and self.max_string_chars < 1:
            raise ValueError(f"max_string_chars must be >= 1 or None, got {self.max_string_chars}")
        if not self.tool_choice:
            raise ValueError("tool_choice must be 'required', 'auto' or a tool's name")


def _bounded(schema: Any, limit: int) -> Any:
    if isinstance(schema, dict):
        bounded = {k: _bounded(v, limit) for k, v in schema.items()}
        if bounded.get("type") == "string" and "maxLength" not in bounded and "enum" not in bounded:
            bounded["maxLength"] = limit
        if bounded.get("type") == "object" and "properties" in bounded:
            bounded.setdefault("additionalProperties", False)
        return bounded
    if isinstance(schema, list):
        return [_bounded(v, limit) for v in schema]
    return schema


def bounded_tools(tools: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """`tools` with `maxLength: limit` on every unbounded string schema and no undeclared object keys
    (`additionalProperties: false` where it is not set), so constrained calls stay short (None: unchanged)."""
    if limit is None:
        return tools
    return [
        {**t, "function": {**t["function"], "parameters": _bounded(t["function"]["parameters"], limit)}}
        for t in tools
    ]


@dataclass
class _Run:
    messages: list[dict[str, Any]]
    answer: str | None = None
    turns: int = 0
    failure: ServerFailure | None = None
    context_exhausted: str | None = None
    """Why the next turn did not fit the context window (the server's message), if it did not."""


def _tool_choice(choice: str) -> Any:
    if choice in ("required", "auto"):
        return choice
    return {"type": "function", "function": {"name": choice}}


async def _turn(
    run: _Run, model: TrainableModel, model_name: str, tools: list[dict[str, Any]], config: AgentConfig
) -> dict[str, Any]:
    client = model.openai_client()
    response = await client.chat.completions.create(
        model=model_name,
        messages=run.messages,
        tools=tools,
        tool_choice=_tool_choice(config.tool_choice),
        max_tokens=config.max_tokens,
        temperature=config.temperature,
    )
    run.turns += 1
    message = response.choices[0].message.model_dump(exclude_none=True)
    reply = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
    reply.setdefault("content", None)
    run.messages.append(reply)
    return reply


async def _act(
    run: _Run, reply: dict[str, Any], connection: ServerConnection, known: set[str], config: ToolCallConfig
) -> None:
    """Run the reply's tool calls, appending one tool message each; sets `run.answer` on complete_task."""
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        if name == COMPLETE_TASK:
            arguments = parse_arguments(function.get("arguments"))
            answer = arguments.get("answer") if isinstance(arguments, dict) else None
            run.answer = str(answer) if answer is not None else ""
            run.messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": "Task complete."})
            return
        outcome = await call_tool(connection, known, name, function.get("arguments"), config)
        run.messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": outcome.content})


async def _loop(
    run: _Run, model: TrainableModel, model_name: str, catalog: ServerCatalog, connection: ServerConnection,
    agent: AgentConfig, tool_config: ToolCallConfig,
) -> None:  # fmt: skip
    tools, known = bounded_tools(catalog.agent_tools(), agent.max_string_chars), set(catalog.tool_names)
    while run.turns < agent.max_turns and run.answer is None:
        try:
            reply = await _turn(run, model, model_name, tools, agent)
        except openai.BadRequestError as exc:
            if exc.code != CONTEXT_LENGTH_EXCEEDED or run.turns == 0:
                raise
            run.context_exhausted = exc.message
            return
        if reply.get("tool_calls"):
            try:
                await _act(run, reply, connection, known, tool_config)
            except ServerFailure as failure:
                run.failure = failure
                return
        elif run.turns < agent.max_turns:
            run.messages.append({"role": "user", "content": NUDGE})


def _finish(scope: RolloutScope, run: _Run, scenario: Scenario) -> None:
    scope.metrics.update(
        turns=run.turns,
        task_completed=run.answer is not None,
        ran_out_of_turns=run.answer is None and run.failure is None and run.context_exhausted is None,
        context_exhausted=run.context_exhausted is not None,
        server_failure=run.failure is not None,
    )
    scope.metadata.update(scenario_id=scenario.id, answer=run.answer)
    if run.failure is not None:
        scope.metadata["failure"] = run.failure.reason
        scope.logs.append(f"rollout failed: {run.failure.reason}")
    if run.context_exhausted is not None:
        scope.logs.append(f"turn {run.turns + 1} did not fit the context window: {run.context_exhausted}")


async def run_agent(
    model: TrainableModel,
    scenario: Scenario,
    catalog: ServerCatalog,
    pool: ServerPool,
    *,
    agent: AgentConfig | None = None,
    tool_config: ToolCallConfig | None = None,
    model_name: str | None = None,
) -> Trajectory:
    """One rollout of `scenario`: a Trajectory with exact tokens, tool messages, logs and metrics.

    A crashed or hung server ends the rollout early: the trajectory then has
    `metrics["server_failure"] = True` and the reason in `logs` and `metadata["failure"]`, and the
    pool replaces the server. Raises ServerStartError when the rollout's server cannot start.
    """
    agent = agent or AgentConfig()
    tool_config = tool_config or ToolCallConfig()
    system = agent.system_prompt.format(server=catalog.server_name or "MCP", max_turns=agent.max_turns)
    run = _Run(messages=[{"role": "system", "content": system}, {"role": "user", "content": scenario.task}])
    async with rollout(model) as scope, pool.lease(scenario.id) as connection:
        await _loop(
            run, model, model_name or model.get_inference_name(), catalog, connection, agent, tool_config
        )
        if run.failure is not None:
            await pool.report_failure(connection, run.failure.reason, hung=run.failure.hung)
        _finish(scope, run, scenario)
    trajectory = scope.trajectory
    captured = [message_key(m) for m in trajectory.messages]
    if [message_key(m) for m in run.messages[: len(captured)]] == captured:
        trajectory.messages = run.messages  # the captured conversation plus the final tool message(s)
    return trajectory


__all__ = ["NUDGE", "SYSTEM_PROMPT", "AgentConfig", "bounded_tools", "run_agent"]
