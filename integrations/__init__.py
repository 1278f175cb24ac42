"""Capture of LLM calls into trajectories: a rollout scope and its doors (OpenAI, LiteLLM, any URL).

```python
from integrations import rollout, rollout_scope

async with rollout(model) as scope:
    await model.openai_client().chat.completions.create(model=model.name, messages=...)
    scope.reward = 1.0
trajectory = scope.trajectory
```

LangGraph (`integrations.langgraph`, imported on first use): `chat_model`, `langgraph_rollout`,
`patch_chat_model`, `TrainableGraph`.
"""

from __future__ import annotations

from typing import Any

from integrations.scope import (
    CaptureFetchError,
    NothingCapturedError,
    RolloutScope,
    current_scope,
    rollout,
    rollout_scope,
)

_LANGGRAPH = ("TrainableGraph", "chat_model", "langgraph_rollout", "patch_chat_model")


def __getattr__(name: str) -> Any:
    """The LangGraph door's names, imported lazily (LangChain takes a second or two to import)."""
    if name in _LANGGRAPH:
        from integrations import langgraph

        return getattr(langgraph, name)
    raise AttributeError(f"module 'integrations' has no attribute {name!r}")


__all__ = [
    "CaptureFetchError",
    "NothingCapturedError",
    "RolloutScope",
    "TrainableGraph",
    "chat_model",
    "current_scope",
    "langgraph_rollout",
    "patch_chat_model",
    "rollout",
    "rollout_scope",
]
