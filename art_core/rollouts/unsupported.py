"""ART names we do not implement in `art_core`, kept so that a ported script fails with directions.

`auto_trajectory` / `capture_auto_trajectory` patch httpx process-wide in ART and collect every
chat call of a coroutine. Here capture is server-side and scoped to a model: our server records
the exact tokens of each call made under a rollout id, and `integrations.rollout(model)` (or
`@integrations.rollout_scope(model)`) turns them into a `Trajectory`. `art_core` may not import
`integrations` (it sits above), so these names only point there.
"""

from __future__ import annotations

from typing import Any, NoReturn


class NotSupportedError(NotImplementedError):
    """An ART feature this project does not offer; the message says what to use instead."""


_CAPTURE = (
    "use `async with integrations.rollout(model) as scope: ...` (then `scope.trajectory`) or decorate "
    "the rollout with `@integrations.rollout_scope(model)`: our server records the exact tokens of every "
    "call made in the scope"
)


def auto_trajectory(required: bool = False) -> NoReturn:
    """ART's current auto-captured trajectory: not supported; see the module docstring."""
    raise NotSupportedError(f"art.auto_trajectory is not supported; {_CAPTURE}")


async def capture_auto_trajectory(coroutine: Any) -> NoReturn:
    """ART's httpx-patching capture: not supported; see the module docstring."""
    if hasattr(coroutine, "close"):
        coroutine.close()
    raise NotSupportedError(f"art.capture_auto_trajectory is not supported; {_CAPTURE}")
