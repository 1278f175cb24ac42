"""ART's `yield_trajectory` / `capture_yielded_trajectory`: return a trajectory from deep inside a call.

```python
async def agent(task):                       # code that returns something else
    ...
    yield_trajectory(Trajectory(messages_and_choices=[...], reward=r))
    return answer

trajectory = await capture_yielded_trajectory(agent(task))
```

The slot is a contextvar, so concurrent captures (one per task) never see each other's trajectory.
Fix over ART: calling `yield_trajectory` outside a capture raises, instead of writing into a
process-wide default slot that nobody reads.
"""

from __future__ import annotations

from collections.abc import Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from art_core.rollouts.records import Trajectory


@dataclass
class _Slot:
    trajectory: Trajectory | None = None


_SLOT: ContextVar[_Slot | None] = ContextVar("art_yielded_trajectory", default=None)


class NoTrajectoryYieldedError(RuntimeError):
    """The captured coroutine finished without calling `yield_trajectory`."""


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (the last call wins)."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"yield_trajectory expects a Trajectory, got {type(trajectory).__name__}")
    slot = _SLOT.get()
    if slot is None:
        raise RuntimeError(
            "yield_trajectory was called outside capture_yielded_trajectory: "
            "run the code as `await capture_yielded_trajectory(coroutine)`"
        )
    slot.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Await `coroutine` and return the trajectory it passed to `yield_trajectory`."""
    token = _SLOT.set(_Slot())
    try:
        await coroutine
        slot = _SLOT.get()
        assert slot is not None
        if slot.trajectory is None:
            raise NoTrajectoryYieldedError(
                f"{getattr(coroutine, '__qualname__', 'the coroutine')} finished without calling "
                "yield_trajectory(trajectory)"
            )
        return slot.trajectory
    finally:
        _SLOT.reset(token)
