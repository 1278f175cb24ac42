"""Capture of LLM calls into trajectories: a rollout scope and its doors (OpenAI, LiteLLM, any URL).

```python
from integrations import rollout, rollout_scope

async with rollout(model) as scope:
    await model.openai_client().chat.completions.create(model=model.name, messages=...)
    scope.reward = 1.0
trajectory = scope.trajectory
```
"""

from __future__ import annotations

from integrations.scope import (
    CaptureFetchError,
    NothingCapturedError,
    RolloutScope,
    current_scope,
    rollout,
    rollout_scope,
)

__all__ = [
    "CaptureFetchError",
    "NothingCapturedError",
    "RolloutScope",
    "current_scope",
    "rollout",
    "rollout_scope",
]
