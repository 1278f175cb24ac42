"""One RULER-scored training step: 4 rollouts of one task, judged against each other, one GRPO step.

    python examples/ruler_one_step.py [--base-model tiny-random|smollm2-135m]
                                      [--judge-mode auto|sampled|weighted|pairwise]
                                      [--judge-base-url URL --judge-model M [--judge-api-key K]]

There is no reward function: RULER's judge scores the replies relative to each other. By default
the judge is the model's own server (the same base model and live LoRA), which needs no API key
and no network; pass `--judge-base-url`/`--judge-model` for any other OpenAI-compatible judge.

`--judge-mode auto` (the default) judges a local judge by its probabilities (the weighted mode:
P("Yes") to "does the reply answer correctly?") and a remote one with sampled JSON scores. A
judge with no probability for either label (the tiny random model) falls back to sampled JSON,
constrained to a schema that names each reply once, so even a random model answers validly.
A 135M judge is weak: point `--judge-base-url`/`--judge-model` at a stronger one when you can.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.backends import LocalBackend
from autorl import JudgeConfig, RulerConfig, ruler_score_group, scored_groups

SYSTEM_PROMPT = "You are a helpful assistant. Answer in one or two sentences."
TASK = "Why is the sky blue?"


async def rollout(model: TrainableModel, max_tokens: int) -> Trajectory:
    """One answer to TASK; no reward here, RULER sets it."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TASK}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, temperature=1.0
    )
    return Trajectory(messages_and_choices=[*messages, completion.choices[0]])


def judge_config(args: argparse.Namespace, model: TrainableModel) -> JudgeConfig:
    """The judge from the flags, or by default the model's own server."""
    if args.judge_base_url:
        model_name = args.judge_model or "judge"
        return JudgeConfig(model=model_name, base_url=args.judge_base_url, api_key=args.judge_api_key)
    return JudgeConfig(
        model=args.judge_model or model.get_inference_name(),
        base_url=model.inference_base_url,
        api_key=model.inference_api_key,
        max_tokens=args.judge_max_tokens,
        cache=False,
        explanation_max_chars=160,  # a small local judge, constrained to the schema, stops in time
    )


async def run(args: argparse.Namespace, path: Path) -> int:
    model = TrainableModel(project="ruler-example", name="agent-001", base_model=args.base_model)
    backend = LocalBackend(path)
    try:
        await model.register(backend)
        group = await TrajectoryGroup(rollout(model, args.max_tokens) for _ in range(args.group_size))
        judge = judge_config(args, model)
        print(f"judge: {judge.model} at {judge.base_url}, mode {args.judge_mode}")
        scored = await ruler_score_group(
            group, judge, on_error="count", config=RulerConfig(mode=args.judge_mode)
        )
        for i, trajectory in enumerate(scored.trajectories, start=1):
            reply = (trajectory.messages[-1].get("content") or "").replace("\n", " ")[:100]
            print(f"[{i}] reward={trajectory.reward} reply={reply!r}")
            print(f"    {trajectory.logs[-1] if trajectory.logs else '(no judge explanation)'}")
        judged = {
            k: scored.metrics[k]
            for k in ("judge_calls", "judge_errors", "judge_fallbacks")
            if k in scored.metrics
        }
        print(f"judge: {judged} ({scored.logs[-1] if scored.logs else ''})")
        groups, ruler_errors = scored_groups([scored])
        if ruler_errors:
            print(f"RULER failed ({ruler_errors} group): {scored.logs[-1]}", file=sys.stderr)
            return 1
        result = await model.train(groups, config=TrainConfig(learning_rate=args.learning_rate))
        print(f"trained step {result.step}: trained={result.trained} metrics={result.metrics}")
        for warning in result.warnings:
            print(f"warning: {warning}")
        return 0
    finally:
        await backend.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="tiny-random", help="tiny-random (fast) or smollm2-135m")
    parser.add_argument("--judge-base-url", default=None, help="OpenAI-compatible judge URL (ending in /v1)")
    parser.add_argument("--judge-model", default=None, help="Judge model name (default: the trained model)")
    parser.add_argument("--judge-api-key", default=None, help="API key of --judge-base-url")
    parser.add_argument(
        "--judge-mode",
        default="auto",
        choices=["auto", "sampled", "weighted", "pairwise"],
        help="How the judge scores (auto: weighted for a local judge, sampled JSON for a remote one)",
    )
    parser.add_argument("--judge-max-tokens", type=int, default=512, help="Longest judge answer (own server)")
    parser.add_argument("--group-size", type=int, default=4, help="Rollouts compared by the judge")
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens per rollout reply")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--path", type=Path, default=None, help="Where checkpoints go (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "LiteLLM", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.path is not None:
        return asyncio.run(run(args, args.path))
    with tempfile.TemporaryDirectory(prefix="ruler-example-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
