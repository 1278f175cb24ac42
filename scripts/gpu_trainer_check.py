"""The trainer on a CUDA GPU, without vLLM: does it learn, agree with the CPU, resume, merge, and how fast.

`scripts/gpu_check.sh` checks the whole GPU path (`art serve --engine vllm`), and needs vLLM; this
script checks the part of it that is ours alone, the GRPO + LoRA `Trainer` on `cuda` with the
settings `ModelService` gives it there (float32 weights moved to the GPU, `matmul_precision="auto"`,
i.e. TF32), on a machine that has torch, transformers, peft, safetensors and pydantic:

- `learns`: a GRPO loop on the tiny random model, sampling with `generate` on the GPU through the
  LoRA being trained; the reward is the fraction of completion tokens in a fixed eighth of the
  vocabulary. Every step with a group of unequal rewards must train, and the last quarter's mean
  reward must beat the first quarter's by 0.2.
- `agrees_with_cpu`: from the same LoRA (randomised, so every weight is exercised) and batch, the
  trainer's log-probs, gradient norm and updated LoRA on the GPU (exact float32) match the CPU's
  within float32 tolerances.
- `resumes`: `save_state` on the GPU (its CUDA RNG state included) and `load_state` into a fresh
  trainer give the same logits and the same next step.
- `merges`: `engine.vllm.merge.merged_tensors` (what the merged weight sync loads into vLLM) on the
  GPU equals peft's own `merge_and_unload` of the saved adapter, to bf16 rounding.
- `timing`: median train-step time (after a warm-up) of a SmolLM2-135M-shaped and a
  Qwen2.5-1.5B-shaped random model (the weights do not change the work), the model's linear
  FLOPs per second against the measured TF32 and bf16 matmul rates, and the peak GPU memory.

Random weights, no download: nothing is read from a hub. Prints one line per check and a JSON
summary last; exit 1 if a check fails.

Usage: python scripts/gpu_trainer_check.py [--device cuda] [--quick]   (`--device cpu`: the dry run)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SMOLLM2_SHAPE = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "initializer_range": 0.02,
}  # fmt: skip
QWEN_1_5B_SHAPE = {
    "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "initializer_range": 0.02,
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, precision: str, n: int) -> float:
    """Best of 5 timed `n x n x n` products on a CUDA `device` (after 2 warm-ups) in TFLOP/s;
    `precision` ("tf32" or "ieee") applies to float32."""
    from art_core.training.precision import matmul_precision

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    with matmul_precision(precision, device):  # type: ignore[arg-type]
        for i in range(7):
            sync(device)
            start = time.perf_counter()
            a @ b
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e12


def batch_of(groups: list[list[tuple[list[int], list[int], float]]], max_context: int) -> Any:
    """A `PreparedBatch` of (prompt ids, completion ids, reward) groups; the trainer computes the old logprobs."""
    from art_core.rollouts.groups import TrajectoryGroup
    from art_core.rollouts.records import Trajectory, Turn
    from art_core.training.batch import prepare_batch

    built = [
        TrajectoryGroup(
            [
                Trajectory(
                    turns=[Turn(prompt_ids=p, completion_ids=c, logprobs=[float("nan")] * len(c))],
                    reward=r,
                )
                for p, c, r in group
            ]
        )
        for group in groups
    ]
    return prepare_batch(built, scale_rewards=True, max_context=max_context)


def random_batch(seed: int, vocab: int, groups: int, size: int, prompt: int, completion: int) -> Any:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=generator).tolist()

    return batch_of(
        [[(ids(prompt), ids(completion), float(i % 2)) for i in range(size)] for _ in range(groups)],
        max_context=prompt + completion + 8,
    )


def tiny(device: torch.device) -> Any:
    from art_core.models.loading import load_model

    loaded = load_model("tiny-random")
    loaded.model.to(device)  # type: ignore[arg-type]  # transformers types `to` oddly
    return loaded


def trainer_for(model: Any, pad_id: int, **config: Any) -> Any:
    from art_core.training.config import LoRAConfig, TrainConfig
    from art_core.training.lora import attach_lora
    from art_core.training.trainer import Trainer

    peft_model = attach_lora(model, LoRAConfig(r=8, alpha=16))
    return Trainer(peft_model, pad_id=pad_id, config=TrainConfig(**config))


# --------------------------------------------------------------------------------------------------
# checks: each returns (passed, details)


def check_learns(device: torch.device, steps: int) -> tuple[bool, dict[str, Any]]:
    loaded = tiny(device)
    tokenizer = loaded.tokenizer
    trainer = trainer_for(loaded.model, tokenizer.pad_token_id, learning_rate=2e-2)
    vocab = loaded.model.config.vocab_size
    target = torch.zeros(vocab, dtype=torch.bool, device=device)
    target[::8] = True
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in ("Say something.", "Count to three.", "Name a colour.", "What is up?")
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rewards, trained = [], []
    generator_seed = 0
    for _ in range(steps):
        groups = []
        for ids in prompt_ids:
            generator_seed += 1
            torch.manual_seed(generator_seed)
            with torch.no_grad():
                out = trainer.model.generate(
                    torch.tensor([ids] * 8, device=device),
                    attention_mask=torch.ones(8, len(ids), dtype=torch.long, device=device),
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                    max_new_tokens=16,
                    min_new_tokens=16,
                    pad_token_id=tokenizer.pad_token_id,
                )
            completions = out[:, len(ids) :]
            scores = target[completions].float().mean(dim=1).tolist()
            groups.append([(ids, c, s) for c, s in zip(completions.tolist(), scores, strict=True)])
        rewards.append(statistics.fmean(s for g in groups for _, _, s in g))
        metrics = trainer.train_step(batch_of(groups, max_context=loaded.max_context))
        varied = any(len({s for _, _, s in g}) > 1 for g in groups)  # else nothing to learn from
        trained.append(metrics["trained"] == 1.0 or not varied)
    k = max(1, steps // 4)
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    passed = all(trained) and last > first + 0.2
    return passed, {
        "rewards": [round(r, 3) for r in rewards],
        "first_mean": round(first, 3),
        "last_mean": round(last, 3),
        "every_varied_step_trained": all(trained),
        "param_device": str(trainer.params[0].device),
    }


def check_agrees_with_cpu(device: torch.device) -> tuple[bool, dict[str, Any]]:
    loaded = tiny(torch.device("cpu"))
    pad = loaded.tokenizer.pad_token_id
    batch = random_batch(3, loaded.model.config.vocab_size, groups=2, size=4, prompt=12, completion=24)
    trainers = {}
    for name, where in (("cpu", torch.device("cpu")), ("gpu", device)):
        model = copy.deepcopy(loaded.model).to(where)
        trainer = trainer_for(model, pad, learning_rate=1e-2, matmul_precision="ieee")
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in trainer.params:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        trainers[name] = trainer
    logprobs = {k: t.compute_logprobs(batch.examples).double().cpu() for k, t in trainers.items()}
    metrics = {k: t.train_step(batch) for k, t in trainers.items()}
    lp_diff = float((logprobs["cpu"] - logprobs["gpu"]).abs().max())
    param_diff = max(
        float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())
        for a, b in zip(trainers["cpu"].params, trainers["gpu"].params, strict=True)
    )
    grad = (metrics["cpu"]["grad_norm"], metrics["gpu"]["grad_norm"])
    grad_rel = abs(grad[0] - grad[1]) / max(abs(grad[0]), 1e-12)
    # float32: ~1e-6 relative per op; sums over hidden (64) and vocab; Adam's first step moves each
    # weight by ~lr, so a tiny gradient difference can flip at most a near-zero update.
    passed = lp_diff < 1e-3 and grad_rel < 1e-3 and param_diff < 1e-4
    return passed, {
        "logprob_max_abs_diff": lp_diff,
        "grad_norm_cpu": grad[0],
        "grad_norm_gpu": grad[1],
        "grad_norm_rel_diff": grad_rel,
        "lora_max_abs_diff_after_step": param_diff,
    }


def check_resumes(device: torch.device) -> tuple[bool, dict[str, Any]]:
    from safetensors import safe_open

    loaded = tiny(device)
    pad = loaded.tokenizer.pad_token_id
    vocab = loaded.model.config.vocab_size
    first = trainer_for(copy.deepcopy(loaded.model), pad, learning_rate=1e-2, weight_decay=0.01)
    first.train_step(random_batch(0, vocab, 2, 4, 8, 16))
    first.train_step(random_batch(1, vocab, 2, 4, 8, 16))
    with tempfile.TemporaryDirectory() as folder:
        first.save_state(Path(folder))
        with safe_open(str(Path(folder) / "rng.safetensors"), framework="pt") as handle:
            rng_keys = sorted(handle.keys())
        torch.manual_seed(7)
        second = trainer_for(copy.deepcopy(loaded.model), pad, learning_rate=1e-2, weight_decay=0.01)
        second.load_state(Path(folder))
    probe = torch.tensor([[5, 17, 300, 42, 9, 100]], device=device)
    with torch.no_grad():
        same_logits = torch.equal(first.model(input_ids=probe).logits, second.model(input_ids=probe).logits)
    batch = random_batch(2, vocab, 2, 4, 8, 16)
    first.train_step(batch)
    second.train_step(batch)
    diff = max(
        float((a.detach() - b.detach()).abs().max()) for a, b in zip(first.params, second.params, strict=True)
    )
    cuda_rng = device.type != "cuda" or any(k.startswith("torch_cuda.") for k in rng_keys)
    return same_logits and diff == 0.0 and cuda_rng, {
        "same_logits": same_logits,
        "next_step_max_abs_diff": diff,
        "rng_tensors": rng_keys,
    }


def check_merges(device: torch.device) -> tuple[bool, dict[str, Any]]:
    from peft import PeftModel

    from art_core.engine.vllm.merge import merged_tensors

    loaded = tiny(torch.device("cpu"))
    pad = loaded.tokenizer.pad_token_id
    base = copy.deepcopy(loaded.model)
    trainer = trainer_for(copy.deepcopy(loaded.model).to(device), pad, learning_rate=1e-2)
    for seed in range(2):
        trainer.train_step(random_batch(seed, loaded.model.config.vocab_size, 2, 4, 8, 16))
    with tempfile.TemporaryDirectory() as folder:
        base_dir, adapter_dir = Path(folder) / "base", Path(folder) / "adapter"
        base.save_pretrained(base_dir)
        trainer.save_state(adapter_dir)
        merged = dict(merged_tensors(adapter_dir, base_dir, dtype=torch.bfloat16, device=device))
        reference = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()
    expected, original = reference.state_dict(), base.state_dict()
    worst, changed = 0.0, 0
    for name, tensor in merged.items():
        want = expected[name].to(torch.float32)
        got = tensor.to(torch.float32).cpu()
        # one bf16 rounding of the float32 sum: half an ulp, at most 2**-8 relative (7 mantissa bits)
        worst = max(worst, float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()))
        changed += int(not torch.equal(want, original[name].to(torch.float32)))
    on_device = all(t.device.type == device.type for t in merged.values())
    passed = bool(merged) and worst <= 2**-8 and changed > 0 and on_device
    return passed, {"tensors": len(merged), "changed_by_lora": changed, "max_rel_diff": worst}


def time_train_step(
    device: torch.device, shape: dict[str, Any], prompt: int, completion: int, repeats: int, precision: str
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = trainer_for(model, 0, learning_rate=1e-5, matmul_precision=precision)
    batch = random_batch(0, shape["vocab_size"], 1, 8, prompt, completion)
    times, trained = [], []
    for _ in range(1 + repeats):
        sync(device)
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync(device)
        times.append(time.perf_counter() - start)
        trained.append(metrics["trained"] == 1.0)
    step = statistics.median(times[1:])
    tokens = 8 * (prompt + completion)
    # forward 2 x params x tokens; backward to the inputs another 2x (the base gets no weight grads);
    # the LM head on completion tokens only, forward + input grad; attention and LoRA left out
    flops = 4 * linear * tokens + 4 * shape["hidden_size"] * shape["vocab_size"] * 8 * completion
    result = {
        "precision": precision,
        "tokens": tokens,
        "warmup_s": round(times[0], 3),
        "step_s": round(step, 4),
        "tokens_per_s": round(tokens / step),
        "model_tflops": round(flops / step / 1e12, 2),
        "all_trained": all(trained),
    }
    if device.type == "cuda":
        result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run(name: str, check: Callable[[], tuple[bool, dict[str, Any]]], results: dict[str, Any]) -> bool:
    start = time.perf_counter()
    try:
        passed, details = check()
    except Exception as exc:  # a check that raises fails, and the others still run
        passed, details = False, {"error": f"{type(exc).__name__}: {exc}"}
    details["seconds"] = round(time.perf_counter() - start, 1)
    results[name] = {"passed": passed, **details}
    print(f"[gpu_trainer_check] {name}: {'ok' if passed else 'FAILED'} {json.dumps(details)}", flush=True)
    return passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer steps, SmolLM2 shape only (the CPU dry run)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[gpu_trainer_check] no CUDA device: run with --device cpu for the dry run", file=sys.stderr)
        return 2
    import peft
    import transformers

    header: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    n = 1024 if args.quick else 8192
    if device.type == "cuda":
        header["tf32_tflops"] = round(matmul_tflops(device, torch.float32, "tf32", n), 1)
        header["bf16_tflops"] = round(matmul_tflops(device, torch.bfloat16, "ieee", n), 1)
        header["fp32_tflops"] = round(matmul_tflops(device, torch.float32, "ieee", n // 2), 1)
    print(f"[gpu_trainer_check] {json.dumps(header)}", flush=True)
    results: dict[str, Any] = {"header": header}
    ok = run("learns", lambda: check_learns(device, 16), results)
    ok &= run("agrees_with_cpu", lambda: check_agrees_with_cpu(device), results)
    ok &= run("resumes", lambda: check_resumes(device), results)
    ok &= run("merges", lambda: check_merges(device), results)
    cases = [("smollm2_135m_shape", SMOLLM2_SHAPE, 32, 64)]
    if not args.quick:
        cases.append(("qwen2.5_1.5b_shape", QWEN_1_5B_SHAPE, 128, 512))
    precisions = ["auto", "ieee"] if device.type == "cuda" else ["auto"]

    def timing() -> tuple[bool, dict[str, Any]]:
        out: dict[str, Any] = {}
        for label, shape, prompt, completion in cases:
            for precision in precisions:
                out[f"{label}/{precision}"] = time_train_step(
                    device, shape, prompt, completion, 2 if args.quick else 5, precision
                )
        return all(r["all_trained"] for r in out.values()), out

    ok &= run("timing", timing, results)
    if "tf32_tflops" in header:
        for key, value in results["timing"].items():
            if isinstance(value, dict):
                rate = header["tf32_tflops"] if key.endswith("/auto") else header["fp32_tflops"]
                value["fraction_of_matmul_rate"] = round(value["model_tflops"] / rate, 3)
    results["passed"] = bool(ok)
    print(json.dumps(results), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
