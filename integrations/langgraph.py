"""The LangGraph door: train an existing graph with one decorator.

```python
from integrations.langgraph import chat_model, langgraph_rollout

graph = create_agent(chat_model(model), tools=[get_price])   # or your own ChatOpenAI(base_url=...)

@langgraph_rollout(model)                  # each call is one rollout and returns a Trajectory
async def rollout(question: str) -> float:
    result = await graph.ainvoke({"messages": [{"role": "user", "content": question}]})
    return score(result)                   # the reward

traced = langgraph_rollout(model)(graph)   # or wrap the compiled graph: each run is a rollout
result, trajectory = await traced.ainvoke(inputs)   # also .invoke, .astream, .stream, .astream_events
```

What is captured. Every chat completion a graph sends to our server inside the rollout carries
the rollout's `X-Rollout-Id` header, and the server records the exact prompt ids, sampled ids and
logprobs. The trajectory is built from those records (`art_core.capture`): the messages exactly
as the model saw them, tool calls as the server parsed them, tool results from the next request.
Several LLM nodes or sub-graphs give one main history plus additional histories; turns merge into
one training sequence only on exact token prefixes. Nothing is pickled or written to disk, no
text is re-tokenised, and LangChain dropping the server's token fields does not matter.

Which chat models carry the header:
- `chat_model(model)`: a `ChatOpenAI` bound to the trained model, always tagged.
- A `ChatOpenAI` of your own pointed at the server: `patch_chat_model(llm)`, or let the decorator
  find it. On every call it walks the decorated graph or function (graph nodes, sub-graphs,
  runnable bindings and sequences, tools, closure variables and the globals a function names) and
  patches every ChatOpenAI whose base URL is the trained model's server. A model built inside a
  node on every call cannot be found that way: build it with `chat_model(model)`.
- Trade-off: patching adds an httpx request hook to the model's httpx client, not to httpx. LangChain
  shares one default httpx client between ChatOpenAI instances with the same base URL and timeout,
  so those are tagged as well (harmless: only requests to the rollout's own server get the header).

Bad wiring is reported, never an empty trajectory. While a rollout runs, a LangChain callback
(langchain_core's configure hook: a contextvar, so it sees only this rollout's runs) counts the
chat-model calls. Nothing captured raises `NothingCapturedError` naming the models that ran and
where they pointed; fewer calls captured than sent to our server logs a warning. A tagged model
called outside any rollout logs a warning once per server.

Streaming: graph streaming works (`stream`/`astream` in any stream mode, `astream_events`), and so
does token streaming: our server streams (SSE), so a `ChatOpenAI(streaming=True)`, `stream_mode=
"messages"` and `astream_events` (`on_chat_model_stream`) get tokens as they are sampled. The
server records a streamed call exactly as a plain one (the same tokens, before the stream ends),
so the trajectory does not depend on streaming. Unsupported by the server for now:
`use_responses_api=True` (no `/v1/responses`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from langgraph.pregel import Pregel

from art_core.types import Trajectory
from integrations.chat_models import (
    _captured_calls,
    _Watch,
    chat_model,
    find_chat_models,
    patch_chat_model,
    patch_reachable,
)
from integrations.scope import (
    RolloutScope,
    _returned_trajectory,
    current_scope,
    rollout,
    rollout_scope,
)

if TYPE_CHECKING:
    from art_core.model import TrainableModel

SyncRolloutScope = RolloutScope
"""The former name of a `RolloutScope` entered with `with` (a `RolloutScope` is entered either way)."""


# -- a compiled graph whose runs are rollouts ---------------------------------------------------

_END = object()


class TrainableGraph:
    """A compiled LangGraph graph whose every run is one captured rollout.

    ```python
    traced = TrainableGraph(graph, model)            # or langgraph_rollout(model)(graph)
    result, trajectory = await traced.ainvoke(inputs)        # or traced.invoke(inputs)
    trajectory.reward = score(result)
    stream = traced.astream(inputs, stream_mode="updates")   # or .stream / .astream_events
    async for chunk in stream: ...
    trajectory = stream.trajectory
    ```
    The ChatOpenAI models the graph reaches that point at the trained model's server are
    patched here and before every run (`chat_models` lists them). A run is a rollout of its own:
    inside an enclosing rollout scope invoke `traced.graph` instead.
    """

    def __init__(self, graph: Pregel, model: TrainableModel) -> None:
        if not isinstance(graph, Pregel):
            raise TypeError(
                f"expected a compiled LangGraph graph (builder.compile()), got {type(graph).__name__}"
            )
        self.graph = graph
        self.model = model
        self.chat_models = patch_reachable(graph, model)
        """The chat models found in the graph and tagged with the rollout id."""

    def __repr__(self) -> str:
        return f"TrainableGraph({self.graph.get_name()!r}, {self.model!r})"

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> tuple[Any, Trajectory]:
        """`graph.ainvoke` as one rollout: the graph's result and the captured trajectory (reward unset)."""
        self._prepare()
        with _Watch(self.model) as watch:
            async with rollout(self.model) as scope:
                result = await self.graph.ainvoke(input, config, **kwargs)
        watch.check(len(scope.records))
        return result, scope.trajectory

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> tuple[Any, Trajectory]:
        """`graph.invoke` as one rollout (blocking); see `ainvoke`."""
        self._prepare()
        with _Watch(self.model) as watch, rollout(self.model) as scope:
            result = self.graph.invoke(input, config, **kwargs)
        watch.check(len(scope.records))
        return result, scope.trajectory

    def astream(self, input: Any, config: Any = None, **kwargs: Any) -> CapturedAsyncStream:
        """`graph.astream` as one rollout: iterate it, then read `.trajectory`."""
        return CapturedAsyncStream(self, lambda: self.graph.astream(input, config, **kwargs))

    def astream_events(self, input: Any, config: Any = None, **kwargs: Any) -> CapturedAsyncStream:
        """`graph.astream_events` as one rollout: iterate it, then read `.trajectory`."""
        return CapturedAsyncStream(self, lambda: self.graph.astream_events(input, config, **kwargs))

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> CapturedStream:
        """`graph.stream` as one rollout (blocking): iterate it, then read `.trajectory`."""
        return CapturedStream(self, lambda: self.graph.stream(input, config, **kwargs))

    def _prepare(self) -> None:
        """Before a run: no enclosing rollout; tag the chat models the graph reaches now."""
        scope = current_scope()
        if scope is not None:
            raise RuntimeError(
                f"a TrainableGraph run is a rollout of its own, but rollout {scope.id} is already active: "
                "inside a rollout scope (or a function decorated with langgraph_rollout) invoke the graph "
                "itself, `traced.graph`"
            )
        self.chat_models = patch_reachable(self.graph, self.model)


class _CapturedRun:
    """A stream of a graph run as one rollout; its trajectory once exhausted."""

    def __init__(self, traced: TrainableGraph, start: Callable[[], Any]) -> None:
        self._traced = traced
        self._start = start
        self._started = False
        self._trajectory: Trajectory | None = None

    @property
    def trajectory(self) -> Trajectory:
        """The rollout's trajectory (reward unset), once the stream has been read to the end."""
        if self._trajectory is None:
            raise RuntimeError("the trajectory is built when the stream ends: read it after the loop")
        return self._trajectory

    def _begin(self) -> None:
        if self._started:
            raise RuntimeError("a captured stream can be iterated once; call astream()/stream() again")
        self._started = True
        self._traced._prepare()


class CapturedStream(_CapturedRun):
    """`TrainableGraph.stream`: a blocking iterator of the graph's chunks."""

    def __iter__(self) -> Iterator[Any]:
        self._begin()
        context = contextvars.copy_context()  # the rollout lives in this context, not the caller's
        body = self._body()
        try:
            while True:
                try:
                    chunk = context.run(next, body)
                except StopIteration:
                    return
                yield chunk
        finally:
            context.run(body.close)

    def _body(self) -> Generator[Any, None, None]:
        model = self._traced.model
        with _Watch(model) as watch, rollout(model) as scope:
            yield from self._start()
        watch.check(len(scope.records))
        self._trajectory = scope.trajectory


class CapturedAsyncStream(_CapturedRun):
    """`TrainableGraph.astream`/`astream_events`: an async iterator of the graph's chunks.

    The graph runs in a task of its own (so the rollout never leaks into the caller's context)
    and hands its chunks over as they come.
    """

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        self._begin()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        producer = asyncio.create_task(self._produce(queue))
        try:
            while (item := await queue.get()) is not _END:
                yield item
            await producer
        finally:
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)

    async def _produce(self, queue: asyncio.Queue[Any]) -> None:
        model = self._traced.model
        try:
            with _Watch(model) as watch:
                async with rollout(model) as scope:
                    async for chunk in self._start():
                        queue.put_nowait(chunk)
            watch.check(len(scope.records))
            self._trajectory = scope.trajectory
        finally:
            queue.put_nowait(_END)


# -- the decorator ------------------------------------------------------------------------------


def langgraph_rollout(model: TrainableModel) -> Callable[[Any], Any]:
    """Decorate a rollout function, or wrap a compiled graph, so that each run is one captured rollout.

    - On an async or a plain function (any arguments) that invokes graphs and returns a reward
      (a number), None (the reward set on `current_scope().reward`) or a `Trajectory`: a function
      with the same arguments that returns the captured `Trajectory`.
    - On a compiled graph: a `TrainableGraph`, whose `ainvoke`/`invoke` return `(result, trajectory)`.

    ChatOpenAI models reachable from the decorated object that point at the trained model's server
    are tagged with the rollout id (see the module docstring); `chat_model(model)` always is.
    """

    def decorate(target: Any) -> Any:
        if isinstance(target, Pregel):
            return TrainableGraph(target, model)
        if inspect.iscoroutinefunction(target):
            return _async_rollout(model, target)
        if callable(target):
            return _sync_rollout(model, target)
        raise TypeError(
            f"langgraph_rollout decorates a compiled graph or a rollout function, got {type(target).__name__}"
        )

    return decorate


def _async_rollout(
    model: TrainableModel, fn: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Trajectory]]:
    scoped = rollout_scope(model)(fn)

    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Trajectory:
        patch_reachable(fn, model)
        with _Watch(model) as watch:
            trajectory = await scoped(*args, **kwargs)
        watch.check(_captured_calls(trajectory))
        return trajectory

    return run


def _sync_rollout(model: TrainableModel, fn: Callable[..., Any]) -> Callable[..., Trajectory]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Trajectory:
        patch_reachable(fn, model)
        with _Watch(model) as watch:
            scope = rollout(model)
            scope._build_on_exit = False  # the trajectory depends on what fn returns
            with scope:
                result = fn(*args, **kwargs)
            trajectory = scope._trajectory = scope.build(_returned_trajectory(scope, result, fn))
        watch.check(_captured_calls(trajectory))
        return trajectory

    return run


__all__ = [
    "CapturedAsyncStream",
    "CapturedStream",
    "SyncRolloutScope",
    "TrainableGraph",
    "chat_model",
    "find_chat_models",
    "langgraph_rollout",
    "patch_chat_model",
    "patch_reachable",
]
