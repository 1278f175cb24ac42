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
- matmul: the machine's fp32 and bf16 `torch.mm` throughput (2048 x 2048, the best of two passes of 5), for the fraction
  of it that our step reaches: the time its matmul FLOPs would take at the rate of the precision each
  runs in (at the mixed precision on a CPU with native bf16: the frozen base projections at the bf16
  rate, the rest at the auto rate), divided by the step's time.

Each runs in its own subprocess (this file with `--worker NAME`), so each peak RSS (`ru_maxrss`) is its
own, with the same torch thread count and the same glibc heap settings (`art_core.models.allocator.keep_freed_memory`, what
the `art` CLI sets: freed memory kept for reuse). The two trainers' processes run side by side but take turns
(ours, trl, ours, trl, ...; the idle one blocks on a pipe), so load from other programs on the machine
hits both alike. A time is the median of `--repeats` steps after one warm-up step. The last line
printed is a JSON object.

Usage: python bench/train_step.py [--repeats 3] [--threads N] [--dtype float32|bfloat16]
[--precision auto|mixed|fp32] [--trl-full]

`--precision auto` (the default) runs each trainer's mixed precision where the CPU has native bf16
(AVX512-BF16 or AMX, probed by `art_core.models.hardware.cpu_has_native_bf16`) and exact fp32 on
both sides where it has not: there TRL's default bf16 autocast is emulated and takes minutes a step.
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
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from machine import machine_header  # bench/ is on sys.path when a bench script runs

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


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class Steps:
    """A worker's side of the turn-taking: wait for "go" on stdin, run one step, answer with its times."""

    def __init__(self, channel: IO[str]) -> None:
        self.channel = channel
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = self._cpu = 0.0

    def ready(self) -> None:
        self.channel.write("ready\n")

    def begin(self) -> None:
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the benchmark stopped this worker")
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def end(self) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu)
        self.channel.write(f"{self.times[-1]}\n")

    def run(self, step: Callable[[], Any], count: int) -> None:
        for _ in range(count):
            self.begin()
            step()
            self.end()


# --------------------------------------------------------------------------------------------------
# workers (each runs in its own process)


def worker_data(args: argparse.Namespace, steps: Steps) -> dict[str, Any]:
    """Prompt ids, 8 sampled completions of exactly 64 tokens, rewards and advantages; model shape."""
    import torch

    from art_core.models.loading import load_model
    from art_core.training.advantages import group_advantages

    loaded = load_model(MODEL)
    rendered: Any = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    prompt_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    model: Any = loaded.model
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
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
        },
        "sample": loaded.tokenizer.decode(completions[0][:16]),
    }


def _lora_snapshot(named: list[tuple[str, Any]]) -> dict[str, Any]:
    return {name: param.detach().clone() for name, param in named}


def _changed(before: dict[str, Any], named: list[tuple[str, Any]]) -> int:
    import torch

    return sum(not torch.equal(before[name], param.detach()) for name, param in named)


def worker_ours(args: argparse.Namespace, steps: Steps, data: dict[str, Any]) -> dict[str, Any]:
    from art_core.models.loading import load_model
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn
    from art_core.training.batch import prepare_batch
    from art_core.training.config import LoRAConfig, LossConfig, TrainConfig
    from art_core.training.lora import attach_lora
    from art_core.training.trainer import Trainer

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
    precision = "auto" if args.precision == "mixed" else "ieee"
    config = TrainConfig(
        learning_rate=LEARNING_RATE, loss=LossConfig(name="grpo"), matmul_precision=precision
    )
    trainer = Trainer(model, pad_id=loaded.tokenizer.pad_token_id, config=config)
    named = list(zip(trainer.param_names, trainer.params, strict=True))
    before = _lora_snapshot(named)
    metrics: list[dict[str, float]] = []
    steps.ready()
    steps.run(lambda: metrics.append(trainer.train_step(batch)), 1 + args.repeats)
    return {
        "times": steps.times[1:],
        "cpu_times": steps.cpu_times[1:],
        "warmup_s": steps.times[0],
        "baseline_gb": baseline,
        "peak_gb": _rss_gb(),
        "changed_params": _changed(before, named),
        "trainable_params": len(named),
        "trained": all(m["trained"] == 1.0 for m in metrics),
        "first_grad_norm": metrics[0]["grad_norm"],
        "shared_prefix_tokens": metrics[-1].get("shared_prefix_tokens", 0.0),
        "micro_batches": metrics[-1]["micro_batches"],
    }


def _trl_trainer(args: argparse.Namespace, max_steps: int, output_dir: str) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from art_core.models.loading import load_model
    from art_core.training.config import DEFAULT_TARGET_MODULES

    loaded = load_model(MODEL, dtype=_dtype(args.dtype))
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=args.dtype == "bfloat16" or args.precision == "mixed",  # TRL's default is bf16=True
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

    def reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        return [float(i % 2 == 0) for i in range(len(completions))]

    return GRPOTrainer(
        model=loaded.model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPT}]}]),
        processing_class=loaded.tokenizer,
        peft_config=lora,
    )


def _trl_callback(begin: Callable[[], None], end: Callable[[], None]) -> Any:
    """A TrainerCallback that calls `begin` when a step starts and `end` when it ends."""
    from transformers import TrainerCallback

    class StepHooks(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            end()

    return StepHooks()


def _trl_inputs(data: dict[str, Any]) -> dict[str, Any]:
    """What TRL's `_generate_and_score_completions` returns for these completions (no old/ref log-probs:
    on-policy with one iteration and beta = 0, as TRL itself does then)."""
    import torch

    prompt = torch.tensor([data["prompt_ids"]] * COMPLETIONS)
    completion = torch.tensor(data["completion_ids"])
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
        "advantages": torch.tensor(data["advantages"], dtype=torch.float32),
        "num_items_in_batch": torch.tensor(float(completion.numel())),
    }


def worker_trl(args: argparse.Namespace, steps: Steps, data: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _trl_trainer(args, 1 + args.repeats, output_dir)
        baseline = _rss_gb()
        inputs = _trl_inputs(data)
        trainer._generate_and_score_completions = lambda batch: {k: v.clone() for k, v in inputs.items()}
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        before = _lora_snapshot(named)
        callback = _trl_callback(steps.begin, steps.end)
        trainer.add_callback(callback)
        steps.ready()
        trainer.train()
        grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        result = {
            "times": steps.times[1:],
            "cpu_times": steps.cpu_times[1:],
            "warmup_s": steps.times[0],
            "baseline_gb": baseline,
            "peak_gb": _rss_gb(),
            "changed_params": _changed(before, named),
            "trainable_params": len(named),
            "first_grad_norm": float(grad_norms[0]),
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
        }
        if args.trl_full:  # TRL's real step: generation and scoring included
            del trainer._generate_and_score_completions
            trainer.remove_callback(callback)
            starts: list[float] = []
            full_times: list[float] = []
            trainer.add_callback(
                _trl_callback(
                    lambda: starts.append(time.perf_counter()),
                    lambda: full_times.append(time.perf_counter() - starts[-1]),
                )
            )
            trainer.args.max_steps = 2
            trainer.train()
            result["full_times"] = full_times
            result["full_peak_gb"] = _rss_gb()
    return result


def worker_matmul(args: argparse.Namespace, steps: Steps) -> dict[str, Any]:
    import torch

    n = 2048
    result: dict[str, Any] = {}
    from art_core.models.hardware import cpu_has_native_bf16
    from art_core.training.precision import matmul_precision

    # Two passes, the best of each: the first float32 measurement of a run read 141-145 GFLOP/s
    # where the same mm read 174-180 seconds later ("mixed", float32 on a CPU without native
    # bf16), and a fraction against the low one read 0.80 instead of 0.64.
    # Without native bf16 a 2048^3 bf16 product runs at ~0.4 GFLOP/s (43 s each, ~9 minutes in
    # all): its rate is measured on 512^3 there, which is as slow per FLOP.
    sizes = {"float32": n, "bfloat16": n if cpu_has_native_bf16() else 512, "mixed": n}
    for _ in range(2):
        for name, precision in (("float32", "ieee"), ("bfloat16", "ieee"), ("mixed", "auto")):
            dtype = _dtype("bfloat16" if name == "bfloat16" else "float32")
            size = sizes[name]
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            with matmul_precision(precision, torch.device("cpu")):  # type: ignore[arg-type]
                torch.mm(a, b)
                best = min(_timed(torch.mm, a, b) for _ in range(5))
            result[name] = max(result.get(name, 0.0), 2 * size**3 / best / 1e9)
    from art_core.training.precision import resolve_precision

    result["bf16_base"] = resolve_precision("auto", torch.device("cpu")) == "bf16"
    return result


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "data": worker_data,
    "ours": worker_ours,
    "trl": worker_trl,
    "matmul": worker_matmul,
}


def run_worker(args: argparse.Namespace) -> None:
    """Entry point of a worker process: protocol lines on the real stdout, everything else on stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries that print (TRL's logs) go to stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch

    from art_core.models.allocator import keep_freed_memory

    keep_freed_memory()  # every worker alike, TRL's too: what our CLI does for its own process
    torch.set_num_threads(args.threads)
    steps = Steps(channel)
    fn = WORKERS[args.worker]
    result = fn(args, steps, json.loads(args.data.read_text())) if args.data else fn(args, steps)
    args.out.write_text(json.dumps(result))


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

    def positions(first: int, last: int, copies: int, only_base: bool = False) -> float:
        """Forward + backward of positions [first, last) for `copies` sequences (`only_base`: the
        frozen base projections' share of it)."""
        if only_base:
            return copies * 2 * base * (last - first)
        keys = sum(p + 1 for p in range(first, last))
        return copies * ((2 * base + 3 * lora) * (last - first) + 3 * per_key * keys)

    naive = positions(0, length, n) + 2 * head
    executed = positions(0, shared_prefix, 1) + positions(shared_prefix, length, n) + 2 * head
    executed_base = positions(0, shared_prefix, 1, True) + positions(shared_prefix, length, n, True)
    # TRL on CPU: every position through the head (forward, recomputed forward, backward) and, with
    # gradient checkpointing, a second forward of the decoder during backward.
    keys = n * sum(p + 1 for p in range(length))
    trl = (3 * base + 4 * lora) * n * length + 4 * per_key * keys + 3 * head * length / completion
    return {"naive": naive, "executed": executed, "executed_base": executed_base, "trl": trl}


# --------------------------------------------------------------------------------------------------
# orchestration


class Worker:
    """A worker process started by the benchmark."""

    def __init__(self, name: str, args: argparse.Namespace, folder: Path, data: Path | None) -> None:
        self.name = name
        self.out = folder / f"{name}.json"
        self.log = open(folder / f"{name}.log", "w+")  # noqa: SIM115
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(self.out)]
        command += ["--threads", str(args.threads), "--repeats", str(args.repeats), "--dtype", args.dtype]
        command += ["--precision", args.precision]
        command += ["--data", str(data)] if data is not None else []
        command += ["--trl-full"] if args.trl_full else []
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.fail()
        return line.strip()

    def wait_ready(self) -> None:
        if self._read() != "ready":
            self.fail()

    def step(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._read())

    def result(self) -> dict[str, Any]:
        if self.proc.wait() != 0:
            self.fail()
        return json.loads(self.out.read_text())

    def fail(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.seek(0)
        sys.stderr.write(self.log.read()[-6000:])
        raise SystemExit(f"benchmark worker {self.name!r} failed (exit code {self.proc.returncode})")


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
    parser.add_argument(
        "--precision",
        choices=["auto", "mixed", "fp32"],
        default="auto",
        help="float32 weights' matmuls: each trainer's default mixed precision (ours: the frozen base "
        "projections on bf16 copies and bf16 fast-math for the rest, where the CPU has native bf16; "
        "TRL: bf16=True autocast), or exact fp32 on both sides; auto: mixed where the CPU has native "
        "bf16, fp32 where it has not (there TRL's bf16 autocast is emulated: minutes a step)",
    )
    parser.add_argument("--trl-full", action="store_true", help="also time TRL's step with generation")
    parser.add_argument("--skip-trl", action="store_true", help="only our trainer (for development)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    args.precision_chosen = args.precision == "auto"
    if args.precision_chosen:
        from art_core.models.hardware import cpu_has_native_bf16

        args.precision = "mixed" if cpu_has_native_bf16() else "fp32"
    if args.worker:
        run_worker(args)
        return

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data_file = folder / "data.json"
        data = Worker("data", args, folder, None).result()
        data_file.write_text(json.dumps(data))
        racers = [Worker("ours", args, folder, data_file)]
        if not args.skip_trl:
            racers.append(Worker("trl", args, folder, data_file))
        for racer in racers:
            racer.wait_ready()
        for _ in range(1 + args.repeats):
            for racer in racers:
                racer.step()
        ours, *rest = [racer.result() for racer in racers]
        trl = rest[0] if rest else None
        matmul = Worker("matmul", args, folder, None).result()
    report(args, data, ours, trl, matmul, (load_before, os.getloadavg()[0]))


def _times(result: dict[str, Any]) -> str:
    return (
        f"median of {[round(t, 3) for t in result['times']]}, CPU {[round(t, 2) for t in result['cpu_times']]}, "
        f"warm-up {result['warmup_s']:.2f} s"
    )


def report(
    args: argparse.Namespace,
    data: dict[str, Any],
    ours: dict[str, Any],
    trl: dict[str, Any] | None,
    matmul: dict[str, Any],
    load: tuple[float, float],
) -> None:
    prompt, n = len(data["prompt_ids"]), len(data["completion_ids"])
    precision = args.precision
    if args.precision_chosen:
        precision += f" (auto: {'native' if precision == 'mixed' else 'no native'} bf16 on this CPU)"
    print(machine_header())
    print(
        f"machine: {os.cpu_count()} CPUs, torch threads {args.threads}, base weights {args.dtype}, "
        f"precision {precision}, "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    if max(load) > (os.cpu_count() or 1) - args.threads + 0.5:
        print(
            "warning: other programs were using the CPUs; times are slower and noisier than on an idle machine"
        )
    print(
        f"data: {n} sequences of {prompt} prompt + {COMPLETION_TOKENS} sampled tokens "
        f"({data['sample']!r}...), advantages {[round(a, 3) for a in data['advantages']]}"
    )
    ours_s = statistics.median(ours["times"])
    print(
        f"ours: {ours_s:.3f} s/step ({_times(ours)}); peak RSS {ours['peak_gb']:.2f} GB "
        f"(after model load {ours['baseline_gb']:.2f}); {ours['changed_params']}/{ours['trainable_params']} "
        f"LoRA tensors updated, first grad norm {ours['first_grad_norm']:.4f}, "
        f"shared prefix {ours['shared_prefix_tokens']:.0f} tokens"
    )
    trl_s = None
    if trl is not None:
        trl_s = statistics.median(trl["times"])
        print(
            f"trl:  {trl_s:.3f} s/step ({_times(trl)}); peak RSS {trl['peak_gb']:.2f} GB "
            f"(after model load {trl['baseline_gb']:.2f}); {trl['changed_params']}/{trl['trainable_params']} "
            f"LoRA tensors updated, first grad norm {trl['first_grad_norm']:.4f}, "
            f"gradient checkpointing {'on' if trl['gradient_checkpointing'] else 'off'}"
        )
        if "full_times" in trl:
            print(
                f"trl with generation of 8 x 64 tokens: {[round(t, 2) for t in trl['full_times']]} s/step, "
                f"peak RSS {trl['full_peak_gb']:.2f} GB"
            )
        print(f"ratio trl/ours: {trl_s / ours_s:.2f}x")
    flops = step_flops(data["model"], prompt, COMPLETION_TOKENS, n, int(ours["shared_prefix_tokens"]))
    if trl_s is not None:
        print(
            f"trl runs about {flops['trl'] / 1e9:.0f} GFLOP per step ({flops['trl'] / flops['executed']:.2f}x ours), "
            f"at {flops['trl'] / 1e9 / trl_s:.0f} GFLOP/s"
        )
    kind = "bfloat16" if args.dtype == "bfloat16" else ("mixed" if args.precision == "mixed" else "float32")
    executed = flops["executed"] / 1e9
    # The time the step's matmuls would take at the 2048^3 rate of the precision each runs in. At
    # the mixed precision on a CPU with native bf16, the frozen base projections run on bf16
    # tensors (art_core/training/bf16_base.py) and the rest (LoRA, attention, head) at the auto
    # precision.
    if kind == "mixed" and matmul.get("bf16_base"):
        base = flops["executed_base"] / 1e9
        ideal_s = base / matmul["bfloat16"] + (executed - base) / matmul["mixed"]
        reference = f"{base:.0f} GFLOP of frozen base projections at the bf16 rate, the rest at the auto rate"
    else:
        ideal_s = executed / matmul[kind]
        reference = f"the {kind} mm throughput"
    fraction = ideal_s / ours_s
    print(
        f"matmul: fp32 {matmul['float32']:.0f} GFLOP/s, bf16 {matmul['bfloat16']:.1f} GFLOP/s, "
        f"fp32 at the trainer's auto precision {matmul['mixed']:.0f} GFLOP/s "
        f"(2048^3 mm, bf16 512^3 without native bf16; best of two passes of 5); our step runs {executed:.0f} GFLOP "
        f"({flops['naive'] / 1e9:.0f} without prefix sharing) at {executed / ours_s:.0f} GFLOP/s "
        f"= {fraction:.1%} of the matmul rate ({reference}: {ideal_s:.3f} s)"
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
