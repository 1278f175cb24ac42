"""An asyncio event loop running in its own daemon thread, for code that must own one loop.

`VLLMEngine` needs it: vLLM's `AsyncLLM` is bound to the loop it first runs in, while callers come
from other loops (uvicorn's, a test's) and from plain threads (the trainer's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running forever in a daemon thread, for coroutines submitted from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block until it is done (never from the loop's own thread)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking call was made from the loop's own thread (it would deadlock)")
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


async def cancel_other_tasks(timeout: float) -> None:
    """Cancel every other task of the running loop and give them `timeout` seconds to finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
