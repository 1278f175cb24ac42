"""The vllm-cpu sides of `serve_throughput.py`: vLLM's OpenAI server with the same adapter, and without.

`start_vllm` launches `vllm.entrypoints.openai.api_server` from `--vllm-python` in its own process
group, with its threads bound to `--threads` CPUs, waits for `/health` and returns the server as a
`Target`, or the reason it could not start (the last exception in its log). Left out: the load and
the report (`serve_throughput.py`); installing vLLM (`scripts/setup_vllm_cpu.sh`).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

from processes import bind_cpus, failure, free_port, stop_group, thread_env
from serve_common import LORA_NAME, LORA_R, MODEL, ROOT, Target, say


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
        "--served-model-name", MODEL, "--dtype", args.dtype,
        "--max-model-len", str(max_len), "--generation-config", "vllm",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if args.vllm_eager:  # vLLM's default is its torch.compile'd model
        argv += ["--enforce-eager"]
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
    bound = f"{args.threads} (bound to {cpus}{', iomp' if args.vllm_iomp else ''}{', eager' if args.vllm_eager else ', compiled'})"
    facts = {"dtype": args.dtype, "threads": bound, "version": version, "start_s": round(start_s, 1)}
    key = "vllm_lora" if adapter_dir else "vllm_base"
    return proc, Target(key, url + "/v1", "none", LORA_NAME if adapter_dir else MODEL, proc.pid), facts
