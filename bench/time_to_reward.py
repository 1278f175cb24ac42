"""Time until the demo task is learned: our loop against TRL's GRPOTrainer, same task, in one run.

    python bench/time_to_reward.py --seeds 3

The task is `art demo`'s (art_core/app/demo.py): SmolLM2-135M-Instruct, the fruit stand's system
prompt and scenarios, reward 1.0 when the reply mentions bananas, 4 scenarios x 8 rollouts per
step, 24 tokens per reply at temperature 1.0, LoRA r=16 (the demo's alpha) on every projection,
learning rate 3e-4. For each seed and each trainer it records the wall time and step count until a
step's mean reward first reaches `--target` (0.8), with `--max-steps` (30) at most, and reports
the median over seeds.

- ours: `run_demo` itself (the in-process server, the `openai` client, TorchEngine rollouts, the
  trainer, a checkpoint per step), the scenario order and every rollout's sampling seeded by the
  seed (`DemoConfig.seed`), as TRL's `seed` seeds its order and sampling.
- trl: `GRPOTrainer` (TRL 1.x) on the same prompts: 32 completions per step (`num_generations` 8),
  `max_completion_length` 24, temperature 1.0, no KL (`beta` 0), PPO clip 0.2, and the settings that
  let it learn on CPU (shared/reference environment notes, section 4): `lr_scheduler_type="constant"`
  (its linear decay kept a toy task flat) and `bf16=False` (`use_cpu=True`; bf16 autocast on a CPU
  without native bf16 is ~50x slower). Gradient checkpointing stays at TRL's default. Rollouts are
  TRL's own `generate`.
- Both average the "grpo" loss over every sequence of the step, zero-variance groups included
  (ours: `LossConfig.normalise_over="scored"`, the default since the fifteenth session).

Times include loading the model (both sides load the same cached safetensors folder, built before
the first run). Each run is its own subprocess (this file with `--worker`), ours and TRL alternating
seed by seed, so load from other programs on a shared machine hits both alike. A run that never
reaches the target within `--max-steps` counts with its full time and `--max-steps` + 1 steps (a
lower bound: the medians then say ">="), and the JSON says how many runs reached it. The last line is JSON:
`{"ours_s", "trl_s", "ratio", "ours_steps", "trl_steps", "seeds", ...}` with ratio = ours_s / trl_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

from art_core.training.config import LossConfig

ROOT = Path(__file__).resolve().parents[1]


class _Reached(Exception):
    """Raised from the step callback to stop a run once the target is reached."""


def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    from art_core.app.demo import DemoConfig, run_demo

    rewards: list[float] = []
    reached: dict[str, float] = {}

    def on_step(step: int, reward: float, seconds: float) -> None:
        rewards.append(reward)
        if reward >= args.target:
            reached.update(step=step, seconds=seconds)
            raise _Reached

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = DemoConfig(
            base_model=args.model, steps=args.max_steps, path=Path(tmp), seed=args.seed, name="ttr"
        )
        try:
            asyncio.run(run_demo(config, on_step))
        except _Reached:
            pass
    return _result(rewards, reached, time.perf_counter() - started)


def _result(rewards: list[float], reached: dict[str, float], total_s: float) -> dict[str, Any]:
    return {
        "rewards": [round(r, 4) for r in rewards],
        "reached": bool(reached),
        "steps": int(reached["step"]) if reached else None,
        "seconds": round(reached["seconds"], 1) if reached else None,
        "total_s": round(total_s, 1),
    }


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from art_core.app.demo import SCENARIOS, SYSTEM_PROMPT, DemoConfig, reward
    from art_core.model import TrainableModel
    from art_core.models.loading import load_model

    demo = DemoConfig(base_model=args.model)
    spec_lora = TrainableModel(project="p", name="n", base_model=args.model, lora_rank=demo.lora_rank).lora
    started = time.perf_counter()
    loaded = load_model(args.model)
    order = list(SCENARIOS)
    random.Random(args.seed).shuffle(order)
    prompts = [
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": s}]}
        for s in order
    ]
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="ttr-trl-"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=demo.scenarios_per_step * demo.group_size,
        num_generations=demo.group_size,
        max_completion_length=demo.max_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        learning_rate=demo.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        num_train_epochs=10**6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    lora = LoraConfig(
        r=spec_lora.r,
        lora_alpha=spec_lora.alpha,
        lora_dropout=0.0,
        target_modules=list(spec_lora.target_modules),
        task_type="CAUSAL_LM",
    )

    def reward_fn(completions: list[Any], **kwargs: Any) -> list[float]:
        return [reward(c[-1]["content"] if isinstance(c, list) else str(c)) for c in completions]

    rewards: list[float] = []
    reached: dict[str, float] = {}

    class Watch(TrainerCallback):
        def on_log(
            self, args_: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            if not logs or "reward" not in logs:
                return
            rewards.append(float(logs["reward"]))
            if rewards[-1] >= args.target and not reached:
                reached.update(step=state.global_step, seconds=time.perf_counter() - started)
                control.should_training_stop = True

    trainer = GRPOTrainer(
        model=loaded.model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=Dataset.from_list(prompts * 64),
        processing_class=loaded.tokenizer,
        peft_config=lora,
        callbacks=[Watch()],
    )
    trainer.train()
    return _result(rewards, reached, time.perf_counter() - started)


def _build_model_cache(model: str) -> None:
    """Convert the model into our cache now, in a process of its own, so that no timed run (the
    first one, ours) pays for building the folder both sides load."""
    code = (
        "import sys; from art_core.models.loading import resolve_model_path; resolve_model_path(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, model], check=True, cwd=ROOT)


def run_worker(args: argparse.Namespace) -> None:
    import torch

    from art_core.models.allocator import keep_freed_memory

    keep_freed_memory()  # both trainers alike: what the `art` CLI does for its own process
    torch.set_num_threads(args.threads)
    result = worker_ours(args) if args.worker == "ours" else worker_trl(args)
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--worker", name, "--seed", str(seed), "--model", args.model,
        "--target", str(args.target), "--max-steps", str(args.max_steps), "--threads", str(args.threads),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {name} worker (seed {seed}) failed:\n{done.stderr[-3000:]}")
    return {"trainer": name, "seed": seed, **json.loads(lines[-1][len("RESULT ") :])}


def summarize(runs: list[dict[str, Any]], max_steps: int) -> dict[str, Any]:
    """Median seconds and steps to the target per trainer; an unreached run counts as its full time
    and max_steps + 1 steps (so the median is then a lower bound)."""
    out: dict[str, Any] = {}
    for name in ("ours", "trl"):
        mine = [r for r in runs if r["trainer"] == name]
        out[f"{name}_s"] = round(
            statistics.median(r["seconds"] if r["reached"] else r["total_s"] for r in mine), 1
        )
        out[f"{name}_steps"] = statistics.median(r["steps"] if r["reached"] else max_steps + 1 for r in mine)
        out[f"{name}_reached"] = sum(r["reached"] for r in mine)
    out["ratio"] = round(out["ours_s"] / out["trl_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per trainer (0, 1, ...)")
    parser.add_argument(
        "--target", type=float, default=0.8, help="a step's mean reward that counts as learned"
    )
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", choices=["ours", "trl"], help="run one trainer only (no ratio)")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    print(machine_header())
    print(
        f"task: art demo ({args.model}, 4 scenarios x 8 rollouts, 24 tokens, LoRA r=16, lr 3e-4); "
        f"target: a step's mean reward >= {args.target} within {args.max_steps} steps; {args.threads} threads"
    )
    loss = LossConfig()
    print(f"ours: run_demo, loss {loss.name} averaged over the {loss.normalise_over} sequences")
    print("trl: GRPOTrainer, use_cpu=True, bf16=False, lr_scheduler_type=constant, beta=0, epsilon=0.2, "
          "gradient checkpointing at its default", flush=True)  # fmt: skip
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before the run (a shared machine): times are noisy", flush=True)
    _build_model_cache(args.model)
    names = [args.only] if args.only else ["ours", "trl"]
    runs: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for name in names:
            run = _spawn(name, seed, args)
            runs.append(run)
            print(json.dumps(run), flush=True)
    if args.only:
        return
    summary = summarize(runs, args.max_steps)
    print(json.dumps({k: summary[k] for k in ("ours_s", "trl_s", "ratio", "ours_steps", "trl_steps")}
                     | {"seeds": args.seeds, "ours_reached": summary["ours_reached"],
                        "trl_reached": summary["trl_reached"]}))  # fmt: skip


if __name__ == "__main__":
    main()
