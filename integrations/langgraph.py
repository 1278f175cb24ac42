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
import logging
import threading
import types
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable
from langchain_core.tracers.context import register_configure_hook
from langgraph.pregel import Pregel

from art_core.capture import ROLLOUT_ID_HEADER, RolloutRecords, active_rollout, server_root
from art_core.types import Trajectory
from integrations.scope import (
    _SCOPE,
    CaptureFetchError,
    NothingCapturedError,
    RolloutScope,
    _returned_trajectory,
    current_scope,
    rollout,
    rollout_scope,
)

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI
    from langchain_openai.chat_models.base import BaseChatOpenAI

    from art_core.model import TrainableModel

logger = logging.getLogger(__name__)

LLM = TypeVar("LLM", bound="BaseChatOpenAI")

# -- the request hook ---------------------------------------------------------------------------

_warned_servers: set[str] = set()


def _tag(request: httpx.Request, warn_outside_scope: bool) -> None:
    rollout_ = active_rollout()
    if rollout_ is not None:
        # A rollout records on its own server only; elsewhere the id would leave orphaned records.
        on_its_server = str(request.url).startswith(rollout_.server_url + "/")
        if on_its_server and ROLLOUT_ID_HEADER not in request.headers:
            request.headers[ROLLOUT_ID_HEADER] = rollout_.id
        return
    server = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
    if warn_outside_scope and "/rollouts/" not in request.url.path and server not in _warned_servers:
        _warned_servers.add(server)
        logger.warning(
            "a chat model of the trained model at %s was called outside any rollout scope, so the call "
            "is not captured for training. Invoke the graph inside a rollout: `langgraph_rollout(model)` "
            "on the graph or on the function that invokes it, or `async with rollout(model)` (warned once "
            "per server; pass warn_outside_scope=False for evaluation calls)",
            server,
        )


class _TagRequests:
    """httpx request hook: the rollout id inside a rollout scope, a one-time warning outside."""

    def __init__(self, warn_outside_scope: bool) -> None:
        self.warn_outside_scope = warn_outside_scope

    def __call__(self, request: httpx.Request) -> None:
        _tag(request, self.warn_outside_scope)


class _TagRequestsAsync(_TagRequests):
    async def __call__(self, request: httpx.Request) -> None:  # type: ignore[override]
        _tag(request, self.warn_outside_scope)


def _install_hook(client: Any, warn_outside_scope: bool) -> None:
    """Add the tagging hook to an `openai.OpenAI`/`AsyncOpenAI` client's httpx client (idempotent)."""
    http = getattr(client, "_client", None)
    if http is None or not hasattr(http, "event_hooks"):
        raise TypeError(f"expected an openai client with an httpx client, got {type(client).__name__}")
    hooks = http.event_hooks
    if any(isinstance(hook, _TagRequests) for hook in hooks["request"]):
        return
    is_async = inspect.iscoroutinefunction(http.send)
    hook = (_TagRequestsAsync if is_async else _TagRequests)(warn_outside_scope)
    hooks["request"] = [*hooks["request"], hook]
    http.event_hooks = hooks


# -- chat models --------------------------------------------------------------------------------


def chat_model(
    model: TrainableModel, *, step: int | None = None, warn_outside_scope: bool = True, **kwargs: Any
) -> ChatOpenAI:
    """A LangChain `ChatOpenAI` bound to the trained model: its calls inside a rollout are captured.

    Defaults (override with keyword arguments, which go to `ChatOpenAI`): temperature 1.0, no
    retries, a 20-minute timeout. `step` serves a given checkpoint (`name@step`) instead of the latest weights.
    """
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("chat_model() needs langchain-openai: pip install langchain-openai") from exc
    from openai import DefaultAsyncHttpxClient, DefaultHttpxClient

    params: dict[str, Any] = {
        "model": model.get_inference_name(step),
        "base_url": model.inference_base_url,
        "api_key": model.inference_api_key,
        "temperature": 1.0,
        "max_retries": 0,
        "timeout": 1200,
        **kwargs,
    }
    params.setdefault("http_client", DefaultHttpxClient())
    params.setdefault("http_async_client", DefaultAsyncHttpxClient())
    return patch_chat_model(ChatOpenAI(**params), warn_outside_scope=warn_outside_scope)


def patch_chat_model(llm: LLM, *, disable_streaming: bool = False, warn_outside_scope: bool = True) -> LLM:
    """Make a `ChatOpenAI` of your own carry the active rollout id; returns it. Idempotent.

    Streamed calls are captured like plain ones. `disable_streaming=True` makes a model that does
    not ask for token streaming itself make plain calls even under `astream_events` or
    `stream_mode="messages"` (LangChain's `disable_streaming`); the default leaves the model as it is.
    """
    clients = [c for c in (getattr(llm, "root_client", None), getattr(llm, "root_async_client", None)) if c]
    if not clients:
        raise TypeError(
            f"expected a langchain_openai ChatOpenAI, got {type(llm).__name__}; build the model with "
            "chat_model(model) or point any client at scope.base_url"
        )
    for client in clients:
        _install_hook(client, warn_outside_scope)
    if disable_streaming and not llm.streaming and llm.disable_streaming is False:
        llm.disable_streaming = True
    return llm


def _serves(base_url: str | None, model: TrainableModel) -> bool:
    """Whether an OpenAI base URL is the trained model's server (its plain `/v1`, not a rollout URL)."""
    if not base_url:
        return False
    try:
        return server_root(base_url) == server_root(model.inference_base_url)
    except ValueError:
        return False


# -- finding the chat models a graph or function uses -------------------------------------------

_MAX_VISITS = 5_000


def _children(obj: Any) -> list[Any]:
    """What a graph, runnable, function or container refers to that may hold a chat model."""
    if isinstance(obj, Pregel):
        return list(obj.nodes.values())
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        try:
            names = inspect.getclosurevars(obj)
        except (TypeError, ValueError):
            return []
        return [*names.nonlocals.values(), *names.globals.values()]
    if isinstance(obj, Runnable) or _is_callable_instance(obj) or type(obj).__name__ == "PregelNode":
        return list(getattr(obj, "__dict__", {}).values())
    return []


def _is_callable_instance(obj: Any) -> bool:
    """An instance of a class with `__call__` (e.g. a node written as a callable object)."""
    return (
        callable(obj) and not isinstance(obj, type | types.BuiltinFunctionType) and hasattr(obj, "__dict__")
    )


def find_chat_models(root: Any) -> list[BaseChatOpenAI]:
    """Every langchain_openai chat model reachable from a graph, runnable or function (bounded walk)."""
    from langchain_openai.chat_models.base import BaseChatOpenAI

    found: list[BaseChatOpenAI] = []
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _MAX_VISITS:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type | types.ModuleType):
            continue
        seen.add(id(obj))
        if isinstance(obj, BaseChatOpenAI):
            found.append(obj)
            continue
        stack.extend(_children(obj))
    return found


def patch_reachable(root: Any, model: TrainableModel) -> list[BaseChatOpenAI]:
    """Patch every ChatOpenAI reachable from `root` that points at `model`'s server; returns them."""
    patched = [llm for llm in find_chat_models(root) if _serves(llm.openai_api_base, model)]
    for llm in patched:
        patch_chat_model(llm)
    return patched


# -- watching the chat-model calls of a rollout -------------------------------------------------

_WATCH: ContextVar[_ChatModelCalls | None] = ContextVar("art_langgraph_watch", default=None)
_hook_lock = threading.Lock()
_hook_registered = False


class _ChatModelCalls(BaseCallbackHandler):
    """Counts the chat-model calls LangChain makes in one rollout: (model name, base URL) each."""

    run_inline = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def on_chat_model_start(self, serialized: dict[str, Any], messages: Any, **kwargs: Any) -> None:
        params = kwargs.get("invocation_params") or {}
        init = (serialized or {}).get("kwargs") or {}
        name = (
            params.get("model")
            or params.get("model_name")
            or (kwargs.get("metadata") or {}).get("ls_model_name")
        )
        self.calls.append((str(name or "?"), init.get("openai_api_base") or init.get("base_url")))


class _Watch:
    """Context manager: counts a rollout's chat-model calls and explains what was not captured."""

    def __init__(self, model: TrainableModel) -> None:
        self.model = model
        self.handler = _ChatModelCalls()
        self._token: contextvars.Token[_ChatModelCalls | None] | None = None

    def __enter__(self) -> _Watch:
        global _hook_registered
        with _hook_lock:
            if not _hook_registered:
                register_configure_hook(_WATCH, inheritable=True)
                _hook_registered = True
        self._token = _WATCH.set(self.handler)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        assert self._token is not None
        _WATCH.reset(self._token)
        if isinstance(exc, NothingCapturedError):
            raise NothingCapturedError(f"{exc}\n{self.explain()}") from None

    def explain(self) -> str:
        """The chat-model calls LangChain saw in this rollout, and what to change."""
        if not self.handler.calls:
            return (
                "LangGraph: no chat-model call ran inside this rollout either; was the graph invoked inside "
                "it (a thread or task started before the rollout does not see it)?"
            )
        ours = self.model.inference_base_url
        lines = ["LangGraph: chat-model calls in this rollout:"]
        for (name, base), count in Counter(self.handler.calls).items():
            if _serves(base, self.model):
                fix = (
                    "the trained model's server; captured only when tagged with the rollout id: build the model "
                    "with chat_model(model) or call patch_chat_model(llm) once (the decorator patches the models "
                    "it can reach, not one built inside a node on every call)"
                )
            else:
                fix = f"not the trained model's server ({ours}): build it with chat_model(model)"
            lines.append(f"  {count} call(s) to {name!r} at {base or 'the default URL'}: {fix}")
        return "\n".join(lines)

    def check(self, captured: int) -> None:
        """Warn when fewer calls were captured than LangChain sent to the trained model's server."""
        sent = sum(1 for _, base in self.handler.calls if _serves(base, self.model))
        if captured < sent:
            logger.warning(
                "LangGraph: %d chat-model call(s) to the trained model's server in this rollout, %d captured\n%s",
                sent,
                captured,
                self.explain(),
            )


def _captured_calls(trajectory: Trajectory) -> int:
    return len(trajectory.turns) + sum(len(h.turns) for h in trajectory.additional_histories)


# -- a synchronous rollout scope ----------------------------------------------------------------


class SyncRolloutScope(RolloutScope):
    """`RolloutScope` for `with` (blocking code: `graph.invoke`, `graph.stream`); fetches with sync httpx."""

    def __enter__(self) -> SyncRolloutScope:
        if self._tokens is not None:
            raise RuntimeError("a RolloutScope can be entered only once; make a new one per rollout")
        from art_core.capture import ActiveRollout, set_active_rollout

        self._tokens = (set_active_rollout(ActiveRollout(self.id, self.server_url)), _SCOPE.set(self))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        from art_core.capture import reset_active_rollout

        assert self._tokens is not None, "__exit__ without __enter__"
        active_token, scope_token = self._tokens
        _SCOPE.reset(scope_token)
        reset_active_rollout(active_token)
        if exc is not None:
            try:
                self.fetch_records_sync()
            except Exception as fetch_exc:
                logger.warning("rollout %s failed and its records could not be freed: %s", self.id, fetch_exc)
            return
        self.records = self.fetch_records_sync()
        if self._build_on_exit:
            self._trajectory = self.build(None)

    def fetch_records_sync(self) -> list[Any]:
        """`fetch_records` with blocking httpx."""
        url = f"{self.server_url}/rollouts/{self.id}"
        auth = {"Authorization": f"Bearer {self.model.inference_api_key}"}
        try:
            with httpx.Client(timeout=self.fetch_timeout) as http:
                response = http.delete(url, headers=auth)
        except httpx.HTTPError as exc:
            raise CaptureFetchError(
                f"could not fetch the records of rollout {self.id} from {url}: {exc}"
            ) from exc
        if response.status_code != 200:
            raise CaptureFetchError(
                f"the server answered {response.status_code} for the records of rollout {self.id} ({url}): "
                f"{response.text[:500]}"
            )
        return RolloutRecords.model_validate_json(response.content).records


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
        with _Watch(self.model) as watch, SyncRolloutScope(self.model) as scope:
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
        with _Watch(model) as watch, SyncRolloutScope(model) as scope:
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
            scope = SyncRolloutScope(model)
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
