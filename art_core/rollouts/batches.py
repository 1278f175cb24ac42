"""ART's `trajectory_group_batches`: stream finished groups in batches while later groups still run.

```python
async for batch in trajectory_group_batches(
    (TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios), batch_size=4
):
    await model.train(batch)
```

Up to `batch_size * max_concurrent_batches` groups run at once; each batch holds the first
`batch_size` groups to finish (completion order, as in ART), the last batch may be smaller.
Failed rollouts stay in their group's `exceptions`; a batch with more failures than
`max_batch_exceptions` (a count, or a fraction in (0, 1) of the batch's rollouts) raises
`GatherError` after cancelling the groups still running.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Iterable

from art_core.rollouts.groups import GatherError, TrajectoryGroup, gather_trajectory_groups


async def _run(group: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup:
    return (await gather_trajectory_groups([group], pbar=False, max_exceptions=math.inf))[0]


def _check_batch(batch: list[TrajectoryGroup], max_batch_exceptions: float) -> None:
    failures = [e for g in batch for e in g.exceptions]
    total = sum(len(g.trajectories) for g in batch) + len(failures)
    limit = max_batch_exceptions * total if 0 < max_batch_exceptions < 1 else max_batch_exceptions
    if len(failures) > limit:
        raise GatherError(
            f"{len(failures)} of {total} rollouts in a batch failed, more than max_batch_exceptions "
            f"({max_batch_exceptions:g}) allows. First failure:\n{failures[0].traceback}",
            failures,
        )


async def trajectory_group_batches(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield batches of `batch_size` finished groups, skipping the first `skip_batches * batch_size` inputs."""
    if batch_size < 1 or max_concurrent_batches < 1 or skip_batches < 0:
        raise ValueError(
            "batch_size and max_concurrent_batches must be >= 1 and skip_batches >= 0; got "
            f"{batch_size}, {max_concurrent_batches}, {skip_batches}"
        )
    if not (max_batch_exceptions >= 0 and not math.isnan(max_batch_exceptions)):
        raise ValueError(f"max_batch_exceptions must be >= 0, got {max_batch_exceptions}")
    inputs = list(groups)
    _discard(inputs[: batch_size * skip_batches])
    unstarted = inputs[batch_size * skip_batches :]
    unstarted.reverse()
    pending: set[asyncio.Task[TrajectoryGroup]] = set()
    ready: list[TrajectoryGroup] = []
    try:
        while unstarted or pending:
            while unstarted and len(pending) < batch_size * max_concurrent_batches:
                pending.add(asyncio.ensure_future(_run(unstarted.pop())))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            ready.extend(task.result() for task in done)
            while len(ready) >= batch_size:
                batch, ready = ready[:batch_size], ready[batch_size:]
                _check_batch(batch, max_batch_exceptions)
                yield batch
        if ready:
            _check_batch(ready, max_batch_exceptions)
            yield ready
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        _discard(unstarted)


def _discard(items: list[TrajectoryGroup | Awaitable[TrajectoryGroup]]) -> None:
    """Close the coroutines of groups that will never run (no 'never awaited' warnings)."""
    for item in items:
        awaitables = item.pending if isinstance(item, TrajectoryGroup) else [item]
        for awaitable in awaitables:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
