"""A TorchEngine in a child process of its own: `ProcessEngine` (the parent's proxy), `SharedLora`.

TorchEngines in one process share its GIL (the Python of every decoding loop) and its OpenMP
pool, so on CPU in-process replicas do not scale (docs/distributed.md). A `ProcessEngine` starts
a child with the multiprocessing "spawn" context: it sets `threads` torch threads before anything
else, builds its model and tokenizer with the picklable `build` it was given (the host's: load the
base weights, attach the LoRA), copies the `SharedLora` in, and serves a TorchEngine on its own
asyncio loop. The parent keeps the `Engine` protocol, streaming (`engine.deltas`), `stats()` and
`closed`, so a `ReplicatedEngine` routes to it as to a TorchEngine.

The two talk over one duplex pipe: the parent sends `(command, id, *args)` and a reader thread
delivers each reply to the request that waits for it (an asyncio future or stream queue, or a
blocking control call). Control commands (pause, resume, adapters, stats, `sync_lora`) run in
order on one thread of the child, so `pause()` returns once the child's running batch ended, as
for a TorchEngine. `sync_lora()` copies the shared-memory LoRA (which the parent rewrote while
every replica was paused) into the child's model and re-merges its serving copy; it returns once
done. When the child exits (killed, crashed) the reader sees the pipe's end: every pending request
fails with `EngineClosedError`, `closed` turns True and `on_death` is called, so the router marks
the replica down even if no request was running on it. A child that fails to start raises
`ReplicaStartError` with its traceback (or after `start_timeout_s`). Left out: which model the
child builds and publishing to several of them (`art_core.host.torch_replicas`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import multiprocessing
import pickle
import signal
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art_core.engine.config import EngineConfig, EngineStats, GenerationRequest
from art_core.engine.deltas import RowDelta
from art_core.engine.errors import EngineClosedError
from art_core.engine.protocol import Completion
from art_core.engine.torch.engine import TorchEngine

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long a child may take to load its model and report ready."""
_END = object()  # a stream's last item


class ReplicaStartError(RuntimeError):
    """A replica's child process failed to start (its traceback is in the message)."""


@dataclass(frozen=True)
class SharedLora:
    """One adapter's parameters in one shared-memory buffer: the parent writes, children read."""

    buffer: torch.Tensor
    """The parameters, flattened one after the other (float32, in shared memory)."""
    layout: tuple[tuple[str, int, tuple[int, ...]], ...]
    """(parameter name, offset in `buffer`, shape), in order."""

    @classmethod
    def of(cls, model: Any, adapter: str) -> SharedLora:
        """A buffer holding peft `model`'s parameters of `adapter` (allocated once)."""
        marker = f".{adapter}."
        params = [(name, p) for name, p in model.named_parameters() if marker in name]
        if not params:
            raise ValueError(f"the model has no parameters of adapter {adapter!r}")
        layout, offset = [], 0
        for name, param in params:
            layout.append((name, offset, tuple(param.shape)))
            offset += param.numel()
        shared = cls(torch.zeros(offset, dtype=torch.float32).share_memory_(), tuple(layout))
        shared.write(model)
        return shared

    def _views(self) -> dict[str, torch.Tensor]:
        return {
            name: self.buffer[offset : offset + math.prod(shape)].view(shape)
            for name, offset, shape in self.layout
        }

    def write(self, model: Any) -> None:
        """Copy `model`'s adapter parameters into the buffer (the trainer's, after a step)."""
        source = dict(model.named_parameters())
        with torch.no_grad():
            for name, view in self._views().items():
                view.copy_(source[name])

    def read(self, model: Any) -> None:
        """Copy the buffer into `model`'s same-named parameters (a replica's, built the same way)."""
        target = dict(model.named_parameters())
        with torch.no_grad():
            for name, view in self._views().items():
                if name not in target:
                    raise ValueError(
                        f"the replica's model has no parameter {name!r}: it was built differently"
                    )
                target[name].copy_(view)


# -- the parent's side ---------------------------------------------------------------------


class ProcessEngine:
    """A TorchEngine serving in a child process (see the module docstring).

    `build`: a picklable callable returning `(peft model, tokenizer)`, run in the child;
    `lora`: the adapter the child's model mirrors (`sync_lora`); `threads`: its torch threads.
    It returns once the child serves; `wait=False` returns at once (several children then load
    side by side) and `wait_ready()` must be called before anything else.
    """

    def __init__(
        self,
        build: Callable[[], tuple[Any, Any]],
        lora: SharedLora,
        config: EngineConfig,
        threads: int,
        name: str = "art-replica",
        start_timeout_s: float = START_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=child_main, args=(child_conn, build, lora, config, threads), name=name, daemon=True
        )
        self._process.start()
        child_conn.close()  # the child holds the only other end: its exit ends our reads
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[str, Any], None]] = {}
        self._ids = itertools.count()
        self._closed = self._closing = False
        self._stats = EngineStats(0, 0, 0, 0)
        self._reap = threading.Lock()  # one thread at a time waits for the child (os.waitpid)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self.on_death: Callable[[ProcessEngine], None] | None = None
        """Called (on the reader thread) when the child exits without `close()`."""
        self.max_context = 0
        """The child engine's context window (set by `wait_ready`)."""
        if wait:
            self.wait_ready(start_timeout_s)

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._process.pid

    @property
    def closed(self) -> bool:
        """Whether it was closed or its child exited (it then serves nothing more)."""
        return self._closed

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until the child serves; ReplicaStartError (with its traceback) if it cannot."""
        try:
            self.max_context = self._ready(timeout_s)
        except BaseException:
            self._closed = True
            self._exit_code(5)
            self._conn.close()
            raise
        self._reader.start()

    def _exit_code(self, wait_s: float) -> int | None:
        """The child's exit code after waiting up to `wait_s` for it to exit (None: still running)."""
        with self._reap:
            self._process.join(wait_s)
            return self._process.exitcode

    def _ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            code = self._exit_code(0)
            if code is not None:
                raise ReplicaStartError(f"{self._process.name} exited (code {code}) while starting")
            if time.monotonic() > deadline:
                self._process.kill()
                raise ReplicaStartError(f"{self._process.name} did not start within {timeout_s:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise ReplicaStartError(
                f"{self._process.name} exited (code {self._exit_code(5)}) while starting; its "
                "traceback is on stderr (a script that starts replica processes needs "
                "`if __name__ == '__main__':`, as with any multiprocessing 'spawn')"
            ) from None
        if kind != "ready":
            raise ReplicaStartError(f"{self._process.name} failed to start:\n{value}")
        return int(value)

    def _read(self) -> None:
        """The reader thread: deliver each reply to its request until the child's pipe ends."""
        while True:
            try:
                kind, rid, value = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                deliver = self._pending.get(rid)
                if kind in ("result", "error", "done"):
                    self._pending.pop(rid, None)
            if deliver is not None:
                deliver(kind, value)
        with self._lock:
            self._closed, pending, self._pending = True, list(self._pending.values()), {}
            died = not self._closing
        why = f"{self._process.name} (pid {self._process.pid}) exited, code {self._exit_code(5)}"
        for deliver in pending:
            deliver("error", EngineClosedError(f"inference replica process {why}"))
        if died:
            logger.error("inference replica process %s", why)
            if self.on_death is not None:
                self.on_death(self)

    def _start(self, command: str, deliver: Callable[[str, Any], None], *args: Any) -> int:
        """Register `deliver` for a new request id and send `command` to the child."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("the replica's process has exited")
            rid = next(self._ids)
            self._pending[rid] = deliver
        try:
            self._send(command, rid, *args)
        except EngineClosedError:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        return rid

    def _send(self, *message: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # the child is gone (the reader fails what waits)
            raise EngineClosedError(f"the replica's process has exited ({exc})") from exc

    def _call(self, command: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run a control command in the child and return its result (blocking)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def deliver(kind: str, value: Any) -> None:
            if kind == "error":
                future.set_exception(value)
            else:
                future.set_result(value)

        self._start(command, deliver, *args)
        return future.result(timeout_s)

    # -- the Engine protocol -----------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """The child's `TorchEngine.generate` (its errors raised here; EngineClosedError if it exits)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Completion]] = loop.create_future()

        def settle(kind: str, value: Any) -> None:
            if not future.done():
                if kind == "error":
                    future.set_exception(value)
                else:
                    future.set_result(value)

        rid = self._start("generate", _on_loop(loop, settle), request)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(rid)
            raise

    def generate_stream(self, request: GenerationRequest) -> AsyncGenerator[list[RowDelta], None]:
        """The child's `TorchEngine.generate_stream`; closing it early cancels the child's rows."""
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[list[RowDelta], None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            queue.put_nowait(_END if kind == "done" else value)

        rid = self._start("stream", _on_loop(loop, put), request)
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
        finally:
            if not ended:
                self._cancel(rid)

    def _cancel(self, rid: int) -> None:
        with self._lock:
            known = self._pending.pop(rid, None) is not None
        if known:
            try:
                self._send("cancel", rid)
            except EngineClosedError:
                pass

    def add_adapter(self, name: str, path: Path) -> None:
        self._call("add_adapter", name, str(path))

    def remove_adapter(self, name: str) -> None:
        self._call("remove_adapter", name)

    def adapters(self) -> list[str]:
        return list(self._call("adapters"))

    def pause(self) -> None:
        """Return once the child's running batch ended; it starts no other until `resume()`."""
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def sync_lora(self) -> None:
        """Copy the shared LoRA into the child's model and re-merge its serving copy; returns when done."""
        self._call("sync_lora")

    def stats(self) -> EngineStats:
        """The child's counters (the last ones read once it has exited)."""
        if not self._closed:
            try:
                self._stats = self._call("stats")
            except EngineClosedError:
                pass
        return self._stats

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the child after its running batch (killed if it does not exit in `timeout_s`)."""
        with self._lock:
            self._closing = True
            serving = not self._closed and self._reader.is_alive()
        if serving:
            try:
                self._stats = self._call("stats", timeout_s=timeout_s)
                self._call("close", timeout_s=timeout_s)
            except (EngineClosedError, concurrent.futures.TimeoutError):
                pass
        elif self._exit_code(0) is None:  # it never served (another replica failed to start)
            self._process.kill()
        if self._exit_code(timeout_s) is None:
            logger.warning("%s did not exit in %.0f s: killing it", self._process.name, timeout_s)
            self._process.kill()
            self._exit_code(5)
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout_s)
        self._conn.close()


def _on_loop(
    loop: asyncio.AbstractEventLoop, deliver: Callable[[str, Any], None]
) -> Callable[[str, Any], None]:
    """`deliver`, called on `loop` (the reader thread is not the event loop's)."""

    def call(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(deliver, kind, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    return call


# -- the child's side ----------------------------------------------------------------------


def child_main(
    conn: Any, build: Callable[[], tuple[Any, Any]], lora: SharedLora, config: EngineConfig, threads: int
) -> None:
    """The child process: torch threads first, then the model, then serve commands until `close`
    (or until the parent's end of the pipe closes). Ctrl-C, and a SIGTERM to the process group (a
    supervisor's stop), reach the whole group: the child ignores both and stops when the parent
    closes it or exits."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, tokenizer = build()
        lora.read(model)
        engine = TorchEngine(model, tokenizer, config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", engine.max_context))
    try:
        asyncio.run(_Child(conn, engine, model, lora).serve())
    finally:
        engine.close()
        conn.close()


class _Child:
    """The child's command loop around its TorchEngine."""

    def __init__(self, conn: Any, engine: TorchEngine, model: Any, lora: SharedLora) -> None:
        self.conn, self.engine, self.model, self.lora = conn, engine, model, lora
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="art-replica-control")

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                message = await loop.run_in_executor(None, self.conn.recv)
            except (EOFError, OSError):  # the parent is gone
                return
            command, rid, *args = message
            if command == "generate":
                self._task(rid, self._generate(rid, args[0]))
            elif command == "stream":
                self._task(rid, self._stream(rid, args[0]))
            elif command == "stats":  # at once, even while a control command waits for a batch
                self._send("result", rid, self.engine.stats())
            elif command == "cancel":
                task = self.tasks.pop(rid, None)
                if task is not None:
                    task.cancel()
            else:
                await self._control(rid, command, args)
                if command == "close":
                    return

    def _task(self, rid: int, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))

    def _send(self, kind: str, rid: int, value: Any) -> None:
        try:
            self.conn.send((kind, rid, value))
        except (OSError, ValueError):  # the parent is gone; the loop ends at its next read
            pass

    async def _generate(self, rid: int, request: GenerationRequest) -> None:
        try:
            self._send("result", rid, await self.engine.generate(request))
        except Exception as exc:
            self._send("error", rid, _portable(exc))

    async def _stream(self, rid: int, request: GenerationRequest) -> None:
        try:
            stream = self.engine.generate_stream(request)
            try:
                async for deltas in stream:
                    self._send("deltas", rid, deltas)
            finally:
                await stream.aclose()
            self._send("done", rid, None)
        except Exception as exc:
            self._send("error", rid, _portable(exc))

    async def _control(self, rid: int, command: str, args: list[Any]) -> None:
        """A control command, run in order on the control thread (it may wait for a batch)."""
        engine = self.engine

        def sync_lora() -> None:
            self.lora.read(self.model)
            engine.weights_updated()

        operations: dict[str, Callable[[], Any]] = {
            "add_adapter": lambda: engine.add_adapter(args[0], args[1]),
            "remove_adapter": lambda: engine.remove_adapter(args[0]),
            "adapters": engine.adapters,
            "pause": engine.pause,
            "resume": engine.resume,
            "sync_lora": sync_lora,
            "close": engine.close,
        }
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.control, operations[command])
        except Exception as exc:
            self._send("error", rid, _portable(exc))
        else:
            self._send("result", rid, result)


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


__all__ = ["ProcessEngine", "ReplicaStartError", "SharedLora", "child_main"]
