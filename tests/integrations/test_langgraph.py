"""The LangGraph door: real graphs (create_agent, create_react_agent, a hand-built StateGraph with a
tool node and two LLM nodes, a sub-graph) against our real server (tiny model, LocalBackend).

The tiny random model never emits a tool call, so the StateGraph's router is test-only and
deterministic: when the agent has not used a tool yet, a scripted node asks for `get_price`, the
real ToolNode runs it, and both LLM nodes see the call and its result. Real tool calls sampled by
SmolLM2 are covered by the slow test at the end.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, create_react_agent
from pydantic import SecretStr

import art_core.capture.context as capture_context
from art_core.backends import LocalBackend
from art_core.model import TrainableModel
from art_core.rollouts.records import Trajectory
from art_core.training.sequences import trajectory_sequences
from integrations import NothingCapturedError, current_scope, rollout
from integrations.langgraph import TrainableGraph, chat_model, langgraph_rollout, patch_chat_model
from tests.helpers_serving import served_fixture

ASYNC = pytest.mark.asyncio(loop_scope="module")
PROMPT_A = "You are the agent. Look prices up."
PROMPT_B = "You are the summariser. Summarise in one sentence."
QUESTION: Any = {"messages": [{"role": "user", "content": "How much is an apple?"}]}


@tool
def get_price(fruit: str) -> str:
    """Look up the price of a fruit."""
    return {"apple": "$0.85 per pound"}.get(fruit, "unknown")


served = served_fixture("langgraph", project="langgraph", name="agent")


def plain_chat_openai(model: TrainableModel, **kwargs: Any) -> ChatOpenAI:
    """A ChatOpenAI a user builds by hand, pointed at our server (not tagged)."""
    return ChatOpenAI(
        base_url=model.inference_base_url,
        api_key=SecretStr(model.inference_api_key),
        model=model.name,
        **kwargs,
    )


def unshared_chat_openai(model: TrainableModel, **kwargs: Any) -> ChatOpenAI:
    """Like `plain_chat_openai`, with an httpx client of its own.

    LangChain shares one default httpx client per (base URL, hashable timeout): a model patched in
    another test would tag this one too. A timeout object (`openai.Timeout`: httpx's or httpx2's, as the
    SDK uses) is unhashable, so the client is new.
    """
    return plain_chat_openai(model, timeout=openai.Timeout(60.0), **kwargs)


def two_llm_graph(agent_llm: Any, summary_llm: Any) -> Any:
    """agent (LLM, tools bound) -> [scripted tool call] -> ToolNode -> agent -> summarise (LLM) -> END."""
    agent_model = agent_llm.bind_tools([get_price])

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [agent_model.invoke([SystemMessage(PROMPT_A), *state["messages"]])]}

    def summarise(state: MessagesState) -> dict[str, Any]:
        return {"messages": [summary_llm.invoke([SystemMessage(PROMPT_B), *state["messages"]])]}

    def plan(state: MessagesState) -> dict[str, Any]:
        call = {"name": "get_price", "args": {"fruit": "apple"}, "id": "call_1", "type": "tool_call"}
        return {"messages": [AIMessage(content="", tool_calls=[call])]}

    def route(state: MessagesState) -> str:
        """Test-only and deterministic: the tiny model never calls tools itself."""
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            return "tools"
        if not any(isinstance(m, ToolMessage) for m in state["messages"]):
            return "plan"
        return "summarise"

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("plan", plan)
    builder.add_node("tools", ToolNode([get_price]))
    builder.add_node("summarise", summarise)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", "plan", "summarise"])
    builder.add_edge("plan", "tools")
    builder.add_edge("tools", "agent")
    builder.add_edge("summarise", END)
    return builder.compile()


def assert_two_histories(trajectory: Trajectory) -> None:
    """The summariser's conversation is the main history; the agent's two calls one additional history."""
    assert trajectory.messages[0]["content"] == PROMPT_B
    roles = ["system", "user", "assistant", "assistant", "tool", "assistant", "assistant"]
    assert [m["role"] for m in trajectory.messages] == roles
    call = trajectory.messages[3]["tool_calls"][0]
    assert call["function"]["name"] == "get_price" and "apple" in call["function"]["arguments"]
    assert trajectory.messages[4] == {"role": "tool", "content": "$0.85 per pound", "tool_call_id": "call_1"}
    assert len(trajectory.turns) == 1
    (agent_history,) = trajectory.additional_histories
    assert agent_history.messages[0]["content"] == PROMPT_A
    assert [t["function"]["name"] for t in agent_history.tools or []] == ["get_price"]
    assert len(agent_history.messages) == 6
    assert len(agent_history.turns) == 2
    # Turns merge into one sequence only on an exact token prefix; histories never merge.
    first, second = agent_history.turns
    so_far = [*first.prompt_ids, *first.completion_ids]
    merged = second.prompt_ids[: len(so_far)] == so_far
    sequences = trajectory_sequences(trajectory)
    assert len(sequences) == 1 + (1 if merged else 2)
    assert (
        list(sequences[0].token_ids[: len(trajectory.turns[0].prompt_ids)]) == trajectory.turns[0].prompt_ids
    )
    for sequence in sequences:
        assert sum(sequence.mask) > 0


def last_ai_text(result: dict[str, Any]) -> str:
    return str(result["messages"][-1].content)


# -- the doors ----------------------------------------------------------------------------------


@ASYNC
async def test_create_agent_with_chat_model_in_a_decorated_rollout(model: TrainableModel) -> None:
    graph = create_agent(chat_model(model, max_tokens=6), tools=[get_price], system_prompt=PROMPT_A)
    seen: list[str | None] = []

    @langgraph_rollout(model)
    async def run(question: str) -> float:
        scope = current_scope()
        seen.append(scope.id if scope else None)
        result = await graph.ainvoke({"messages": [{"role": "user", "content": question}]})
        return 0.5 if last_ai_text(result) else 0.25

    trajectory = await run("How much is an apple?")
    assert trajectory.reward in (0.5, 0.25)
    assert trajectory.metadata["rollout_id"] == seen[0]
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant"]
    assert [t["function"]["name"] for t in trajectory.tools or []] == ["get_price"]
    (turn,) = trajectory.turns
    assert len(turn.completion_ids) == len(turn.logprobs) <= 6 and turn.prompt_ids


@ASYNC
async def test_create_react_agent_with_a_plain_chat_openai_is_found_and_patched(
    model: TrainableModel,
) -> None:
    llm = unshared_chat_openai(model, max_tokens=5)
    traced = langgraph_rollout(model)(create_react_agent(llm, [get_price], prompt=PROMPT_A))
    assert isinstance(traced, TrainableGraph) and traced.chat_models == [llm]
    result, trajectory = await traced.ainvoke(QUESTION)
    assert trajectory.messages[-1]["content"] == last_ai_text(result)
    assert trajectory.reward is None and len(trajectory.turns) == 1


@ASYNC
async def test_state_graph_with_tool_node_and_two_llm_nodes_async(model: TrainableModel) -> None:
    traced = TrainableGraph(
        two_llm_graph(chat_model(model, max_tokens=4), unshared_chat_openai(model, max_tokens=4)), model
    )
    assert len(traced.chat_models) == 2  # the agent's model was tagged already; the summariser's is patched
    result, trajectory = await traced.ainvoke(QUESTION)
    assert trajectory.messages[-1]["content"] == last_ai_text(result)
    assert_two_histories(trajectory)


def test_state_graph_sync_invoke_and_sync_decorated_function(model: TrainableModel) -> None:
    graph = two_llm_graph(unshared_chat_openai(model, max_tokens=4), chat_model(model, max_tokens=4))
    _, trajectory = TrainableGraph(graph, model).invoke(QUESTION)
    assert_two_histories(trajectory)

    @langgraph_rollout(model)
    def run() -> float:
        assert current_scope() is not None
        graph.invoke(QUESTION)
        return 1.0

    trajectory = run()
    assert trajectory.reward == 1.0
    assert_two_histories(trajectory)


@ASYNC
@pytest.mark.parametrize("mode", ["updates", "values", "messages"])
async def test_state_graph_astream(model: TrainableModel, mode: str) -> None:
    traced = TrainableGraph(
        two_llm_graph(chat_model(model, max_tokens=4), unshared_chat_openai(model, max_tokens=4)), model
    )
    stream = traced.astream(QUESTION, stream_mode=mode)
    with pytest.raises(RuntimeError, match="after the loop"):
        _ = stream.trajectory
    chunks = [chunk async for chunk in stream]
    assert len(chunks) >= 4
    assert current_scope() is None  # the rollout never leaked into this context
    assert_two_histories(stream.trajectory)


@ASYNC
async def test_graph_streamed_inside_a_decorated_rollout(model: TrainableModel) -> None:
    graph = two_llm_graph(chat_model(model, max_tokens=4), unshared_chat_openai(model, max_tokens=4))

    @langgraph_rollout(model)
    async def run() -> None:
        chunks = [chunk async for chunk in graph.astream(QUESTION, stream_mode="messages")]
        assert len(chunks) >= 3
        scope = current_scope()
        assert scope is not None
        scope.reward = 0.75

    trajectory = await run()
    assert trajectory.reward == 0.75
    assert_two_histories(trajectory)


@ASYNC
async def test_state_graph_astream_events_and_sync_stream(model: TrainableModel) -> None:
    traced = TrainableGraph(
        two_llm_graph(chat_model(model, max_tokens=4), unshared_chat_openai(model, max_tokens=4)), model
    )
    events = traced.astream_events(QUESTION, version="v2")
    kinds = {event["event"] async for event in events}
    assert {"on_chat_model_start", "on_chat_model_end", "on_tool_end"} <= kinds
    assert_two_histories(events.trajectory)

    stream = traced.stream(QUESTION, stream_mode="messages")
    assert len(list(stream)) >= 3
    assert_two_histories(stream.trajectory)


@ASYNC
async def test_streaming_chat_openai_gives_the_same_trajectory_as_plain_calls(model: TrainableModel) -> None:
    """Token streaming (`ChatOpenAI(streaming=True)`) inside a rollout: the same seeded tokens and messages."""
    trajectories = []
    for streaming in (False, True):
        llm = unshared_chat_openai(model, max_tokens=6, seed=9, temperature=1.0, streaming=streaming)
        traced = langgraph_rollout(model)(create_react_agent(llm, [get_price], prompt=PROMPT_A))
        result, trajectory = await traced.ainvoke(QUESTION)
        assert trajectory.messages[-1]["content"] == last_ai_text(result)
        trajectories.append(trajectory)
    plain, streamed = trajectories
    assert streamed.messages == plain.messages and len(streamed.turns) == 1
    assert streamed.turns[0].prompt_ids == plain.turns[0].prompt_ids
    assert streamed.turns[0].completion_ids == plain.turns[0].completion_ids
    assert streamed.turns[0].logprobs == pytest.approx(plain.turns[0].logprobs)

    # chat_model() streams tokens under stream_mode="messages" and astream_events.
    agent = create_agent(chat_model(model, max_tokens=6), tools=[get_price], system_prompt=PROMPT_A)
    events = langgraph_rollout(model)(agent).astream_events(QUESTION, version="v2")
    streamed_tokens = [e async for e in events if e["event"] == "on_chat_model_stream"]
    (turn,) = events.trajectory.turns
    assert len(streamed_tokens) > 1
    assert (
        "".join(str(e["data"]["chunk"].content) for e in streamed_tokens)
        == events.trajectory.messages[-1]["content"]
    )
    assert len(turn.completion_ids) <= 6


@ASYNC
async def test_sub_graph_and_a_second_llm_node(model: TrainableModel) -> None:
    research = create_agent(chat_model(model, max_tokens=4), tools=[get_price], system_prompt=PROMPT_A)
    answer_llm = unshared_chat_openai(model, max_tokens=4)

    async def answer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await answer_llm.ainvoke([SystemMessage(PROMPT_B), *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("research", research)
    builder.add_node("answer", answer)
    builder.add_edge(START, "research")
    builder.add_edge("research", "answer")
    builder.add_edge("answer", END)
    traced = TrainableGraph(builder.compile(), model)
    assert answer_llm in traced.chat_models
    _, trajectory = await traced.ainvoke(QUESTION)
    assert trajectory.messages[0]["content"] == PROMPT_B  # the answer node saw the longer conversation
    (research_history,) = trajectory.additional_histories
    assert research_history.messages[0]["content"] == PROMPT_A
    assert len(trajectory_sequences(trajectory)) == 2


# -- bad wiring ---------------------------------------------------------------------------------


@ASYNC
async def test_chat_model_pointed_at_another_server_raises(model: TrainableModel, tmp_path: Path) -> None:
    other = TrainableModel(project="langgraph", name="other", base_model="tiny-random")
    async with LocalBackend(tmp_path) as other_backend:
        await other.register(other_backend)
        graph = create_agent(chat_model(other, max_tokens=3), tools=[get_price])

        @langgraph_rollout(model)
        async def run() -> float:
            await graph.ainvoke(QUESTION)
            return 1.0

        with pytest.raises(NothingCapturedError) as caught:
            await run()
        assert (
            other_backend.recorder.stats()["rollouts"] == 0
        )  # no id sent to a server that is not the rollout's
    message = str(caught.value)
    assert "1 call(s) to 'other'" in message
    assert other.inference_base_url in message and "not the trained model's server" in message


@ASYNC
async def test_chat_model_built_inside_a_node_is_not_found_and_says_so(model: TrainableModel) -> None:
    def node(state: MessagesState) -> dict[str, Any]:
        return {"messages": [unshared_chat_openai(model, max_tokens=3).invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("node", node)
    builder.add_edge(START, "node")
    traced = TrainableGraph(builder.compile(), model)
    assert traced.chat_models == []
    with pytest.raises(
        NothingCapturedError, match=r"captured only when tagged with the rollout id.*chat_model\(model\)"
    ):
        await traced.ainvoke(QUESTION)

    # The fix the message gives: build it with chat_model(model).
    def fixed(state: MessagesState) -> dict[str, Any]:
        return {"messages": [chat_model(model, max_tokens=3).invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("node", fixed)
    builder.add_edge(START, "node")
    _, trajectory = await TrainableGraph(builder.compile(), model).ainvoke(QUESTION)
    assert len(trajectory.turns) == 1


@ASYNC
async def test_partly_captured_rollout_warns(model: TrainableModel, caplog: pytest.LogCaptureFixture) -> None:
    llm = chat_model(model, max_tokens=3)

    def tagged(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    def untagged(state: MessagesState) -> dict[str, Any]:
        return {
            "messages": [
                unshared_chat_openai(model, max_tokens=3).invoke(
                    [SystemMessage(PROMPT_B), *state["messages"]]
                )
            ]
        }

    builder = StateGraph(MessagesState)
    builder.add_node("tagged", tagged)
    builder.add_node("untagged", untagged)
    builder.add_edge(START, "tagged")
    builder.add_edge("tagged", "untagged")
    with caplog.at_level(logging.WARNING, logger="integrations.chat_models"):
        _, trajectory = await TrainableGraph(builder.compile(), model).ainvoke(QUESTION)
    assert len(trajectory.turns) == 1
    assert "2 chat-model call(s) to the trained model's server in this rollout, 1 captured" in caplog.text


@ASYNC
async def test_graph_invoked_outside_a_rollout_warns_once(
    model: TrainableModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture_context, "_warned_servers", set())
    graph = create_agent(chat_model(model, max_tokens=3), tools=[get_price])
    with caplog.at_level(logging.WARNING, logger="art_core.capture.context"):
        await graph.ainvoke(QUESTION)
        await graph.ainvoke(QUESTION)
    warnings = [r for r in caplog.records if "outside any rollout scope" in r.getMessage()]
    assert len(warnings) == 1
    caplog.clear()
    quiet = create_agent(
        chat_model(model, max_tokens=3, warn_outside_scope=False, timeout=openai.Timeout(60.0)), []
    )
    monkeypatch.setattr(capture_context, "_warned_servers", set())
    with caplog.at_level(logging.WARNING, logger="art_core.capture.context"):
        await quiet.ainvoke(QUESTION)
    assert "outside any rollout scope" not in caplog.text


@ASYNC
async def test_trainable_graph_inside_a_rollout_scope_is_an_error(model: TrainableModel) -> None:
    traced = TrainableGraph(create_agent(chat_model(model, max_tokens=3), tools=[]), model)
    async with rollout(model) as scope:
        with pytest.raises(RuntimeError, match="invoke the graph itself"):
            await traced.ainvoke(QUESTION)
        await traced.graph.ainvoke(QUESTION)  # the graph itself joins the enclosing rollout
    assert len(scope.trajectory.turns) == 1
    with pytest.raises(TypeError, match="compiled graph or a rollout function"):
        langgraph_rollout(model)(42)
    with pytest.raises(TypeError, match="ChatOpenAI"):
        patch_chat_model(object())  # type: ignore[type-var]


@ASYNC
async def test_no_files_written_but_model_storage(
    served: tuple[LocalBackend, TrainableModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = served
    storage = backend.service.base_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    traced = TrainableGraph(
        two_llm_graph(chat_model(model, max_tokens=3), unshared_chat_openai(model, max_tokens=3)), model
    )
    before = sorted(storage.rglob("*"))

    @langgraph_rollout(model)
    def sync_rollout() -> float:
        traced.graph.invoke(QUESTION)
        return 1.0

    await traced.ainvoke(QUESTION)
    _ = [chunk async for chunk in traced.astream(QUESTION)]
    sync_rollout()
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory or the temp dir
    assert sorted(storage.rglob("*")) == before  # and nothing new in the model storage (no pickles, no logs)


# -- real tool calls (SmolLM2) ------------------------------------------------------------------


@pytest.mark.slow
async def test_smollm2_tool_calls_and_results_are_captured(tmp_path: Path) -> None:
    import asyncio
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "langgraph_agent.py"
    spec = importlib.util.spec_from_file_location("example_langgraph_agent", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    model = TrainableModel(project="langgraph", name="smol", base_model="smollm2-135m")
    async with LocalBackend(tmp_path) as backend:
        await model.register(backend)
        run = example.build_rollout(model, max_tokens=32)
        trajectories = await asyncio.gather(*(run("mango") for _ in range(24)))
    start = len(example.FEW_SHOT) + 2  # system prompt, worked examples, question
    one_call = [  # call -> tool result -> answer (a rollout may also loop on tools until the limit)
        t
        for t in trajectories
        if [m["role"] for m in t.messages[start:]] == ["assistant", "tool", "assistant"]
    ]
    assert one_call, "SmolLM2 made no single tool call in 24 tries (its base rate is about 25%)"
    for trajectory in one_call:
        call, result, answer = trajectory.messages[start:]
        name = call["tool_calls"][0]["function"]["name"]
        # The tool's answer, or LangChain's error message when the model passed wrong arguments or
        # named a tool that does not exist (sampled, so it happens): either way the tool result the
        # agent saw is in the trajectory.
        if name == "get_price":
            assert result["content"].startswith(("$", "no price", "Error invoking tool 'get_price'"))
        else:
            assert name in result["content"] and "get_price" in result["content"], result["content"]
        assert not answer.get("tool_calls")
        assert len(trajectory.turns) == 2 and not trajectory.additional_histories  # the call and the answer
        assert all(len(t.completion_ids) == len(t.logprobs) for t in trajectory.turns)
