"""The Langfuse sink for real: the langfuse SDK exports to a receiving endpoint on 127.0.0.1 that
decodes the OTLP it sends with OpenTelemetry's proto package (tests/helpers_otlp.py). Rollouts are
captured by a real rollout scope: two LLM calls to our server (tiny model) around a real MCP tool
call (examples/mcp/server.py as a subprocess), then one train step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("langfuse")
pytest.importorskip("opentelemetry.proto")

from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups  # noqa: E402
from art_core.backends import LocalBackend  # noqa: E402
from integrations import rollout  # noqa: E402
from integrations.mcp import record_tool_calls  # noqa: E402
from tests.helpers_mcp import EXAMPLE_SERVER  # noqa: E402
from tests.helpers_otlp import TRACES_PATH, Receiver, serve  # noqa: E402

ASYNC = pytest.mark.asyncio(loop_scope="function")
ROLLOUTS = 3


async def _rollout(model: TrainableModel, tools: object, index: int) -> Trajectory:
    async with rollout(model) as scope:
        client = model.openai_client()
        messages: list[dict[str, object]] = [{"role": "user", "content": f"how many figs? ({index})"}]
        first = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=3)
        result = await tools.call_tool("stock_level", {"product": "figs"})  # type: ignore[attr-defined]
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": f"the tool said {result.content[0].text}"},
        ]
        await client.chat.completions.create(model=model.name, messages=messages, max_tokens=3)
        scope.reward = index / (ROLLOUTS - 1)
    return scope.trajectory


@ASYNC
async def test_each_rollout_is_a_trace_with_its_llm_and_tool_calls_and_its_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver()
    server, url = serve(receiver)
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_HOST", url)
    try:
        params = StdioServerParameters(command=sys.executable, args=[str(EXAMPLE_SERVER)])
        async with LocalBackend(tmp_path) as backend, Client(params, cache=None) as raw:
            tools = record_tool_calls(raw)
            model = TrainableModel(project="lf", name="agent", base_model="tiny-random")
            await model.register(backend)
            groups = await gather_trajectory_groups(
                [TrajectoryGroup(_rollout(model, tools, i) for i in range(ROLLOUTS))], pbar=False
            )
            result = await model.train(groups, config=TrainConfig(learning_rate=1e-2))
        trajectories = groups[0].trajectories
    finally:
        server.shutdown()

    assert result.step == 1 and any(path == TRACES_PATH for path, _ in receiver.requests)
    rollout_ids = {str(t.metadata["rollout_id"]) for t in trajectories}
    roots = [s for s in receiver.spans if s.name == "rollout"]
    assert len(roots) == ROLLOUTS and {s.trace_id for s in roots} == rollout_ids
    by_trace = {t: [s for s in receiver.spans if s.trace_id == t] for t in rollout_ids}
    for trajectory in trajectories:
        spans = by_trace[str(trajectory.metadata["rollout_id"])]
        root = next(s for s in spans if s.name == "rollout")
        llm = [s for s in spans if s.name == "llm"]
        assert len(llm) == 2 == len(trajectory.turns) and all(s.parent_id == root.span_id for s in llm)
        for span, turn in zip(llm, trajectory.turns, strict=True):
            assert span.attributes["langfuse.observation.type"] == "generation"
            usage = json.loads(span.attributes["langfuse.observation.usage_details"])
            assert usage == {"input": len(turn.prompt_ids), "output": len(turn.completion_ids)}
            assert turn.seconds is not None and turn.seconds > 0
            assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(turn.seconds, abs=0.05)
        (tool,) = [s for s in spans if s.name == "tool stock_level"]
        assert tool.attributes["langfuse.observation.type"] == "tool" and tool.parent_id == root.span_id
        assert json.loads(tool.attributes["langfuse.observation.input"]) == {"product": "figs"}
        assert "4" in tool.attributes["langfuse.observation.output"] and tool.end_ns > tool.start_ns
    scores = {s["traceId"]: s for s in receiver.scores}
    assert set(scores) == rollout_ids
    for trajectory in trajectories:
        score = scores[str(trajectory.metadata["rollout_id"])]
        assert score["name"] == "reward" and score["value"] == pytest.approx(trajectory.reward)
