"""Time one GRPO + LoRA training step of art_core's Trainer and of TRL's GRPOTrainer on the same data.

Data: SmolLM2-135M-Instruct, one short chat prompt rendered with its chat template, 8 completions of
exactly 64 tokens sampled once from the base model (seed 0), rewards 1,0,1,0,... and the group-relative
advantages computed from them. Both trainers get LoRA r=8, alpha=16 on q/k/v/o/gate/up/down, the
`grpo` loss (PPO clip 0.2, mean over each sequence's tokens, mean over sequences), no KL, a constant
learning rate and one AdamW step with the gradient norm clipped to 1.0.

- ours: `Trainer.train_step` on the `PreparedBatch` (collate, forward, backward, optimizer step).
- trl: `GRPOTrainer.train()` with its generation-and-scoring function replaced by one that returns the
  same 8 completions and advantages, so a step is TRL's own training work: `_prepare_inputs`,
  `compute_loss` (fused chunked LM head), backward, gradient clipping, optimizer and scheduler step.
  Gradient checkpointing is left at TRL's default (on). `--trl-full` also times TRL's real step,
  generation of 8 x 64 tokens included (printed, not part of the JSON).
- matmul: the machine's fp32 and bf16 `torch.mm` throughput (2048 x 2048, best of 5), for the fraction
  of it that our step reaches.

Each runs in its own subprocess (this file with `--worker NAME`), so that each peak RSS
(`ru_maxrss`) is its own. Every worker uses the same torch thread count. Times are the median of
`--repeats` steps after one warm-up step. The last line printed is a JSON object.

Usage: python bench/train_step.py [--repeats 3] [--threads N] [--dtype float32|bfloat16] [--trl-full]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
PROMPT = "Write a short poem about the sea and the wind."
COMPLETIONS = 8
COMPLETION_TOKENS = 64
LEARNING_RATE = 1e-5
LORA_R, LORA_ALPHA = 8, 16


def _rss_gb() -> float:
    """Peak resident set size of this process so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _setup(threads: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(threads)


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# --------------------------------------------------------------------------------------------------
# workers (each runs in its own process)


def worker_data(args: argparse.Namespace) -> dict[str, Any]:
    """Prompt ids, 8 sampled completions of exactly 64 tokens, rewards and advantages; model shape."""
    import torch

    from art_core.advantages import group_advantages
    from art_core.models import load_model

    loaded = load_model(MODEL)
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = list(
        loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    )
    if prompt_ids and not isinstance(prompt_ids[0], int):  # a BatchEncoding-like answer
        prompt_ids = list(
            loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        )
    torch.manual_seed(0)
    with torch.no_grad():
        out = loaded.model.generate(
            torch.tensor([prompt_ids] * COMPLETIONS),
            attention_mask=torch.ones(COMPLETIONS, len(prompt_ids), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=COMPLETION_TOKENS,
            min_new_tokens=COMPLETION_TOKENS,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
    completions = out[:, len(prompt_ids) :].tolist()
    assert all(len(c) == COMPLETION_TOKENS for c in completions)
    rewards = [float(i % 2 == 0) for i in range(COMPLETIONS)]
    cfg = loaded.model.config
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completions,
        "rewards": rewards,
        "advantages": group_advantages(rewards, scale=True).advantages,
        "model": {
            "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size,
            "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "vocab": cfg.vocab_size,
            "params": sum(p.numel() for p in loaded.model.parameters()),
        },
        "sample": loaded.tokenizer.decode(completions[0][:24]),
    }


def _lora_snapshot(named: list[tuple[str, Any]]) -> dict[str, Any]:
    return {name: param.detach().clone() for name, param in named}


def _changed(before: dict[str, Any], named: list[tuple[str, Any]]) -> int:
    import torch

    return sum(not torch.equal(before[name], param.detach()) for name, param in named)


def worker_ours(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from art_core.batch import prepare_batch
    from art_core.config import TrainConfig
    from art_core.lora import LoRAConfig, attach_lora
    from art_core.loss import LossConfig
    from art_core.models import load_model
    from art_core.trainer import Trainer
    from art_core.types import Trajectory, TrajectoryGroup, Turn

    loaded = load_model(MODEL, dtype=_dtype(args.dtype))
    baseline = _rss_gb()
    turns = [
        Turn(prompt_ids=data["prompt_ids"], completion_ids=c, logprobs=[float("nan")] * len(c))
        for c in data["completion_ids"]
    ]
    group = TrajectoryGroup(
        [Trajectory(turns=[turn], reward=r) for turn, r in zip(turns, data["rewards"], strict=True)]
    )
    batch = prepare_batch([group], scale_rewards=True, max_context=loaded.max_context)
    assert [e.advantage for e in batch.examples] == data["advantages"], "advantages differ from the data's"
    model = attach_lora(loaded.model, LoRAConfig(r=LORA_R, alpha=LORA_ALPHA))
    config = TrainConfig(learning_rate=LEARNING_RATE, loss=LossConfig(name="grpo"))
    trainer = Trainer(model, pad_id=loaded.tokenizer.pad_token_id, config=config)
    named = list(zip(trainer.param_names, trainer.params, strict=True))
    before = _lora_snapshot(named)
    start = time.perf_counter()
    metrics = trainer.train_step(batch)
    warmup = time.perf_counter() - start
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    return {
        "times": times,
        "cpu_times": cpu_times,
        "warmup_s": warmup,
        "baseline_gb": baseline,
        "peak_gb": _rss_gb(),
        "changed_params": _changed(before, named),
        "trainable_params": len(named),
        "trained": metrics["trained"],
        "loss": metrics["loss"],
        "shared_prefix_tokens": metrics.get("shared_prefix_tokens", 0.0),
        "micro_batches": metrics["micro_batches"],
    }


def _trl_trainer(args: argparse.Namespace, data: dict[str, Any], output_dir: str, max_steps: int) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from art_core.lora import DEFAULT_TARGET_MODULES
    from art_core.models import load_model

    loaded = load_model(MODEL, dtype=_dtype(args.dtype))
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        per_device_train_batch_size=COMPLETIONS,
        num_generations=COMPLETIONS,
        max_completion_length=COMPLETION_TOKENS,
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS},
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    lora = LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=list(DEFAULT_TARGET_MODULES),
        task_type="CAUSAL_LM",
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPT}]}])

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [float(i % 2 == 0) for i in range(len(completions))]

    return loaded, GRPOTrainer(
        model=loaded.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=loaded.tokenizer,
        peft_config=lora,
    )


def _step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self._start = self._cpu = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._start, self._cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self._start)
            self.cpu_times.append(time.process_time() - self._cpu)

    return StepTimer()


def worker_trl(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    import torch

    with tempfile.TemporaryDirectory() as output_dir:
        loaded, trainer = _trl_trainer(args, data, output_dir, max_steps=1 + args.repeats)
        baseline = _rss_gb()
        prompt = torch.tensor([data["prompt_ids"]] * COMPLETIONS)
        completion = torch.tensor(data["completion_ids"])
        inputs = {
            "prompt_ids": prompt,
            "prompt_mask": torch.ones_like(prompt),
            "completion_ids": completion,
            "completion_mask": torch.ones_like(completion),
            "advantages": torch.tensor(data["advantages"], dtype=torch.float32),
            "num_items_in_batch": torch.tensor(float(completion.numel())),
        }
        # TRL's step minus generation and scoring: the same completions and advantages every step.
        trainer._generate_and_score_completions = lambda batch: {k: v.clone() for k, v in inputs.items()}
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        before = _lora_snapshot(named)
        timer = _step_timer()
        trainer.add_callback(timer)
        trainer.train()
        result = {
            "times": timer.times[1:],
            "cpu_times": timer.cpu_times[1:],
            "warmup_s": timer.times[0],
            "baseline_gb": baseline,
            "peak_gb": _rss_gb(),
            "changed_params": _changed(before, named),
            "trainable_params": len(named),
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
        }
        if args.trl_full:
            del trainer._generate_and_score_completions
            trainer.remove_callback(timer)
            full = _step_timer()
            trainer.add_callback(full)
            trainer.args.max_steps = 2
            trainer.train()
            result["full_times"] = full.times
            result["full_peak_gb"] = _rss_gb()
    return result


def worker_matmul(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = 2048
    result = {}
    for name in ("float32", "bfloat16"):
        a = torch.randn(n, n).to(_dtype(name))
        b = torch.randn(n, n).to(_dtype(name))
        torch.mm(a, b)
        best = min(_timed(torch.mm, a, b) for _ in range(5))
        result[name] = 2 * n**3 / best / 1e9
    return result


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


WORKERS = {"data": worker_data, "ours": worker_ours, "trl": worker_trl, "matmul": worker_matmul}


# --------------------------------------------------------------------------------------------------
# FLOPs


def step_flops(
    model: dict[str, int], prompt: int, completion: int, n: int, shared_prefix: int
) -> dict[str, float]:
    """Matmul FLOPs of one training step (forward + backward); the formula is in docs/benchmarks.md.

    Per token and layer: 2 * (weights of q, k, v, o, gate, up, down) for the base, 2 * r * (in + out) per
    LoRA layer, and 4 * heads * head_dim per attended key. Head: 2 * V * H per trained position.
    Backward with a frozen base: activation gradients only for the base and the head (= forward),
    activation + weight gradients for LoRA (= 2 x forward), attention = 2 x forward.
    "naive" runs every sequence in full; "executed" runs the first `shared_prefix` positions once.
    """
    h, i, layers = model["hidden"], model["intermediate"], model["layers"]
    q, kv = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]
    base = 2 * (h * q + 2 * h * kv + q * h + 3 * h * i) * layers
    lora = 2 * LORA_R * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)) * layers
    per_key = 4 * model["heads"] * model["head_dim"] * layers
    head = 2 * model["vocab"] * h * n * completion
    length = prompt + completion - 1  # input positions of one sequence

    def decoder(first: int, copies: int) -> float:
        """Forward + backward of positions [first, length) for `copies` sequences."""
        tokens = copies * (length - first)
        keys = copies * sum(p + 1 for p in range(first, length))
        return (2 * base + 3 * lora) * tokens + 3 * per_key * keys

    def prefix(count: int) -> float:
        return (2 * base + 3 * lora) * count + 3 * per_key * sum(p + 1 for p in range(count))

    naive = decoder(0, n) + 2 * head
    executed = prefix(shared_prefix) + decoder(shared_prefix, n) + 2 * head
    return {"naive": naive, "executed": executed}


# --------------------------------------------------------------------------------------------------
# orchestration


def _run_worker(
    name: str, args: argparse.Namespace, data_file: Path | None, out_file: Path
) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(out_file)]
    command += ["--threads", str(args.threads), "--repeats", str(args.repeats), "--dtype", args.dtype]
    if data_file is not None:
        command += ["--data", str(data_file)]
    if args.trl_full:
        command.append("--trl-full")
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"worker {name!r} failed with exit code {proc.returncode}")
    result = json.loads(out_file.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def _median(times: list[float]) -> float:
    return statistics.median(times)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step (median)")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads per worker"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="base weights' dtype"
    )
    parser.add_argument("--trl-full", action="store_true", help="also time TRL's step with generation")
    parser.add_argument("--skip-trl", action="store_true", help="only our trainer (for development)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        _setup(args.threads)
        fn = WORKERS[args.worker]
        data = json.loads(args.data.read_text()) if args.data else None
        result = fn(args) if data is None else fn(args, data)  # type: ignore[operator]
        args.out.write_text(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data_file = folder / "data.json"
        data = _run_worker("data", args, None, data_file)
        data_file.write_text(json.dumps(data))
        ours = _run_worker("ours", args, data_file, folder / "ours.json")
        trl = None if args.skip_trl else _run_worker("trl", args, data_file, folder / "trl.json")
        matmul = _run_worker("matmul", args, None, folder / "matmul.json")
    report(args, data, ours, trl, matmul)


def report(
    args: argparse.Namespace,
    data: dict[str, Any],
    ours: dict[str, Any],
    trl: dict[str, Any] | None,
    matmul: dict[str, Any],
) -> None:
    prompt, n = len(data["prompt_ids"]), len(data["completion_ids"])
    print(f"machine: {os.cpu_count()} CPUs, torch threads {args.threads}, base weights {args.dtype}")
    print(
        f"data: {n} sequences of {prompt} prompt + {COMPLETION_TOKENS} sampled tokens "
        f"(first: {data['sample']!r}...), advantages {[round(a, 3) for a in data['advantages']]}"
    )
    ours_s = _median(ours["times"])
    print(
        f"ours: {ours_s:.3f} s/step (median of {[round(t, 3) for t in ours['times']]}, warm-up {ours['warmup_s']:.2f} s), "
        f"peak RSS {ours['peak_gb']:.2f} GB (after model load {ours['baseline_gb']:.2f} GB), "
        f"{ours['changed_params']}/{ours['trainable_params']} LoRA tensors updated, "
        f"shared prefix {ours['shared_prefix_tokens']:.0f} tokens"
    )
    trl_s = None
    if trl is not None:
        trl_s = _median(trl["times"])
        print(
            f"trl:  {trl_s:.3f} s/step (median of {[round(t, 3) for t in trl['times']]}, warm-up {trl['warmup_s']:.2f} s), "
            f"peak RSS {trl['peak_gb']:.2f} GB (after model load {trl['baseline_gb']:.2f} GB), "
            f"{trl['changed_params']}/{trl['trainable_params']} LoRA tensors updated, "
            f"gradient checkpointing {'on' if trl['gradient_checkpointing'] else 'off'}"
        )
        if "full_times" in trl:
            print(
                f"trl with generation (8 x 64 tokens): {[round(t, 2) for t in trl['full_times']]} s/step, "
                f"peak RSS {trl['full_peak_gb']:.2f} GB"
            )
        print(f"ratio trl/ours: {trl_s / ours_s:.2f}x")
    flops = step_flops(data["model"], prompt, COMPLETION_TOKENS, n, int(ours["shared_prefix_tokens"]))
    peak = matmul[args.dtype]
    fraction = flops["executed"] / ours_s / 1e9 / peak
    print(
        f"matmul: fp32 {matmul['float32']:.0f} GFLOP/s, bf16 {matmul['bfloat16']:.0f} GFLOP/s (2048^3 mm, best of 5); "
        f"our step executes {flops['executed'] / 1e9:.0f} GFLOP ({flops['naive'] / 1e9:.0f} without prefix sharing) "
        f"= {flops['executed'] / 1e9 / ours_s:.0f} GFLOP/s = {fraction:.1%} of {args.dtype} mm throughput"
    )
    result = {
        "ours_s": round(ours_s, 3),
        "trl_s": None if trl_s is None else round(trl_s, 3),
        "ratio": None if trl_s is None else round(trl_s / ours_s, 2),
        "ours_peak_gb": round(ours["peak_gb"], 2),
        "trl_peak_gb": None if trl is None else round(trl["peak_gb"], 2),
        "matmul_fraction": round(fraction, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
