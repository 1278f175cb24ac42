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

Merged weights (`weight_sync="merged"`). vLLM is built without LoRA; `load_merged(path, names)`
closes the gate, waits for the admitted requests, has every worker merge the LoRA folder into the
base weights and reload the targeted layers in place (`merged_weights`), resets the prefix cache
(its KV was computed with the old weights), and then serves those weights under `names`. A request
naming a name the newest load did not give (an older step) fails at admission with
UnknownAdapterError. While asleep the load is deferred to `resume()`, after waking.

Related modules: `config` (`VLLMEngineConfig`), `router` (which adapter serves `name` and
`name@step` as training goes on), `cpu_lora` (the CPU LoRA fix, vllm#48421), `merged_weights` and
`merge` (merged mode's worker side and its math).

Import cost: this module does not import vLLM; the engine does when it is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_core.engine.config import GenerationRequest
from art_core.engine.errors import (
    ContextLengthError,
    EngineClosedError,
    InvalidRequestError,
    UnknownAdapterError,
)
from art_core.engine.finish_reason import FinishReason
from art_core.engine.protocol import Completion
from art_core.engine.torch.decoding import BASE_ADAPTER
from art_core.engine.vllm.config import VLLMEngineConfig
from art_core.engine.vllm.loop_thread import LoopThread, cancel_other_tasks

__all__ = ["VLLMEngine", "VLLMEngineConfig"]

logger = logging.getLogger(__name__)


@dataclass
class _Adapter:
    name: str
    request: Any  # vllm LoRARequest
    registered: bool  # engine.add_lora was called (False: deferred while asleep)


class VLLMEngine:
    """The `Engine` protocol on vLLM's AsyncLLM; see the module docstring.

    `model_path` is an HF folder (what `load_model(...).path` gives). `tokenizer`, when given,
    adds its eos id to the stop ids (our tokenizers end turns on `<|im_end|>`; not for a request with
    `ignore_eos`, which vLLM gets as its own `ignore_eos`). Building the
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
        self._merged: frozenset[str] = frozenset()  # weight_sync="merged": the names of the loaded weights
        self._deferred_merge: str | None = None  # a LoRA folder to merge on waking
        self._switch = asyncio.Lock()  # pause, resume and load_merged one at a time
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
        self._runner = LoopThread("art-vllm-engine")
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
        if self.config.serves_lora and not cpu and kwargs["dtype"] in ("float32", "float"):
            raise ValueError(
                "vLLM's GPU LoRA kernels take float16/bfloat16 only: use VLLMEngineConfig(dtype='auto' or "
                "'bfloat16') (auto serves a float32 checkpoint in bf16), or enable_lora=False"
            )
        fix_lora = self.config.serves_lora and cpu
        if fix_lora:
            kwargs.setdefault("worker_extension_cls", "art_core.engine.vllm.cpu_lora.CPULoRAFix")
        if self.config.weight_sync == "merged":
            kwargs.setdefault(
                "worker_extension_cls", "art_core.engine.vllm.merged_weights.MergedWeightsLoader"
            )
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
        if request.grammar is not None:
            raise InvalidRequestError(
                f"constrained decoding ({request.grammar.description}: response_format json_schema/"
                "json_object, tool_choice required or named) is not supported by the vLLM engine yet: "
                "serve this model with the torch engine, or send the request without it"
            )
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
        eos = frozenset() if params.ignore_eos else self._extra_stop
        return VLLMSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=min(params.max_tokens, room),
            stop=list(params.stop) or None,
            stop_token_ids=sorted(set(params.stop_token_ids) | eos) or None,
            ignore_eos=params.ignore_eos,  # vLLM then also leaves out the generation config's eos ids
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
        if self.config.weight_sync == "merged":
            if adapter not in self._merged:
                raise UnknownAdapterError(
                    f"no weights {adapter!r} are loaded: weight_sync='merged' serves one set of weights, now "
                    f"as {sorted(self._merged)} (an older step needs weight_sync='lora')"
                )
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
        """Hot-load the peft LoRA folder `path` as `name`; requests can name it once this returns.

        A same-named adapter is replaced at once: requests already running finish on the old
        weights (unloaded after them), every request admitted later, including those waiting
        while paused, gets the new ones. No restart; ~0.03 s on CPU for SmolLM2 rank 8."""
        if self.config.weight_sync == "merged":
            raise InvalidRequestError(
                "this engine has weight_sync='merged' (no LoRA in vLLM): use load_merged, or weight_sync='lora'"
            )
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
        if self._users[lora_id] > 0 or self._sleeping:  # removed when its requests end, or after waking
            self._doomed.add(lora_id)
        else:
            await self._llm.remove_lora(lora_id)

    def adapters(self) -> list[str]:
        """Names of the adapters requests may use (merged mode: the names of the loaded weights)."""
        return sorted(self._merged if self.config.weight_sync == "merged" else self._adapters)

    # -- merged weights --------------------------------------------------------------------

    def load_merged(self, path: Path, names: Sequence[str]) -> dict[str, float]:
        """weight_sync="merged": serve the base weights with the peft LoRA folder `path` merged in,
        under `names` (requests name one of them, or none), replacing the previous load and its names.

        No request sees half-loaded weights: new requests wait while the running ones finish, the
        layers are reloaded, the prefix cache is reset, then the waiting requests run on the new
        weights. Returns the workers' first report (tensors, elements, seconds). If the load
        fails, no name is served until a later load succeeds."""
        if self.config.weight_sync != "merged":
            raise InvalidRequestError("load_merged needs VLLMEngineConfig(weight_sync='merged')")
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path} is not a peft adapter folder (no adapter_config.json)")
        self._check_open()
        report: dict[str, float] = self._runner.call(self._load_merged(str(path.resolve()), frozenset(names)))
        return report

    async def _load_merged(self, path: str, names: frozenset[str]) -> dict[str, float]:
        async with self._switch:
            hold = not self._paused  # paused: the gate is closed already and stays so until resume()
            if hold:
                self._gate.clear()
            try:
                await self._idle.wait()
                self._merged = frozenset()
                report: dict[str, float] = {}
                if self._sleeping:
                    self._deferred_merge = path
                else:
                    report = await self._apply_merge(path)
                self._merged = names
                return report
            finally:
                if hold:
                    self._gate.set()

    async def _apply_merge(self, path: str) -> dict[str, float]:
        reports = await self._llm.collective_rpc("art_load_merged", args=(path, self.model_path))
        if not await self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight load")
        report: dict[str, float] = reports[0]
        logger.info("vLLM merged weights from %s: %s", path, report)
        return report

    def lora_ids(self) -> set[int]:
        """The LoRA int ids vLLM holds right now (for tests and diagnostics)."""
        self._check_open()
        return set(self._runner.call(self._llm.list_loras()))

    # -- pause / close ---------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether `pause()` holds new requests back (until `resume()`)."""
        return self._paused

    @property
    def sleeping(self) -> bool:
        """Whether vLLM is asleep (paused with `sleep_mode`)."""
        return self._sleeping

    def pause(self) -> None:
        """Hold new requests, wait for the admitted ones to finish, then sleep (with `sleep_mode`)."""
        self._check_open()
        self._runner.call(self._pause())

    async def _pause(self) -> None:
        async with self._switch:
            await self._pause_now()

    async def _pause_now(self) -> None:
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
        async with self._switch:
            await self._resume_now()

    async def _resume_now(self) -> None:
        if not self._paused:
            return
        if self._sleeping:
            await self._llm.wake_up()
            self._sleeping = False
            if self._deferred_merge is not None:  # loaded while asleep
                path, self._deferred_merge = self._deferred_merge, None
                try:
                    await self._apply_merge(path)
                except BaseException:
                    self._merged = frozenset()  # half-loaded: no name is served; requests fail, not hang
                    self._paused = False
                    self._gate.set()
                    raise
            for entry in self._adapters.values():
                if not entry.registered:
                    entry.registered = await self._llm.add_lora(entry.request)
            for lora_id in [i for i in self._doomed if self._users[i] <= 0]:  # retired while asleep
                self._doomed.discard(lora_id)
                await self._llm.remove_lora(lora_id)
        self._paused = False
        self._gate.set()

    def close(self) -> None:
        """Shut vLLM down; running, waiting and later requests get EngineClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.call(self._shutdown(), timeout=120)
            self._runner.call(cancel_other_tasks(timeout=10), timeout=30)
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
        finish_reason=FinishReason.LENGTH if finish == "length" else FinishReason.STOP,
    )
