"""`retry`: ART's retry decorator for sync and async functions, with exponential backoff.

```python
@retry(max_attempts=3, delay=0.25, backoff_factor=2.0, exceptions=(openai.APITimeoutError,))
async def rollout(model, scenario) -> Trajectory: ...
```

Semantics as in ART (`art.utils.retry`): `max_attempts` calls in all; after failed attempt `n`
(not the last), `on_retry(exc, n)` is called (or a warning is logged), then it sleeps `delay *
backoff_factor ** (n - 1)` seconds. The last failure is re-raised unchanged; exceptions outside
`exceptions` propagate at once. One fix: arguments are checked when the decorator is built
(ART accepts `max_attempts=0`, then raises an `AssertionError` on the first call).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger(__name__)

OnRetry = Callable[[Exception, int], None]
"""Called with the exception and the number of the attempt that failed (from 1)."""


def _check(max_attempts: int, delay: float, backoff_factor: float, exceptions: tuple[type, ...]) -> None:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    if not (math.isfinite(delay) and delay >= 0):
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    if not (math.isfinite(backoff_factor) and backoff_factor >= 0):
        raise ValueError(f"backoff_factor must be a finite number >= 0, got {backoff_factor!r}")
    if not isinstance(exceptions, tuple) or not all(
        isinstance(e, type) and issubclass(e, BaseException) for e in exceptions
    ):
        raise TypeError(f"exceptions must be a tuple of exception classes, got {exceptions!r}")


def _report(
    on_retry: OnRetry | None, func: Callable[..., Any], exc: Exception, attempt: int, total: int
) -> None:
    if on_retry is not None:
        on_retry(exc, attempt)
    else:
        name = getattr(func, "__qualname__", repr(func))
        logger.warning("Retry %d/%d for %s after error: %s", attempt, total, name, exc)


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: OnRetry | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Retry the decorated function (sync or async) on `exceptions`, up to `max_attempts` calls in all."""
    _check(max_attempts, delay, backoff_factor, exceptions)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as exc:
                        if attempt == max_attempts:
                            raise
                        _report(on_retry, func, cast(Exception, exc), attempt, max_attempts)
                        await asyncio.sleep(wait)
                        wait *= backoff_factor
                raise AssertionError("unreachable")

            return cast(Callable[P, R], run_async)

        @functools.wraps(func)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as exc:
                    if attempt == max_attempts:
                        raise
                    _report(on_retry, func, cast(Exception, exc), attempt, max_attempts)
                    time.sleep(wait)
                    wait *= backoff_factor
            raise AssertionError("unreachable")

        return run

    return decorate
