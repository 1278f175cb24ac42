"""The trained model's LangChain chat models: tagged with the rollout id, found, and watched.

- Tagging (`chat_model`, `patch_chat_model`): capture's one request hook (`art_core.capture.
  install_hook`) on the model's clients adds the active rollout's `X-Rollout-Id` header to requests to
  the rollout's own server, and warns once per server when a tagged model is called outside any rollout.
- Finding (`find_chat_models`, `patch_reachable`): a bounded walk of a graph, runnable or function
  (nodes, sub-graphs, bindings, closures, the globals a function names) for ChatOpenAI models.
- Watching (`_Watch`): a LangChain callback that counts a rollout's chat-model calls, to explain a
  rollout that captured nothing or fewer calls than it sent.

The LangGraph door (`integrations.langgraph`) puts these together; see its docstring.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
import types
from collections import Counter
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable
from langchain_core.tracers.context import register_configure_hook
from langgraph.pregel import Pregel

from art_core.capture import install_hook, server_root
from art_core.types import Trajectory
from integrations.scope import NothingCapturedError

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI
    from langchain_openai.chat_models.base import BaseChatOpenAI

    from art_core.model import TrainableModel

logger = logging.getLogger(__name__)

LLM = TypeVar("LLM", bound="BaseChatOpenAI")

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
        install_hook(client, warn_outside_scope=warn_outside_scope)
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


__all__ = ["chat_model", "find_chat_models", "patch_chat_model", "patch_reachable"]
