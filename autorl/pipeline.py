"""`autorl.train`: from a task description to a trained model and a before/after score.

Inputs (generated, or read from a file) -> rollouts judged by RULER -> GRPO steps -> head-to-head
on the validation inputs (trained vs step 0, both orders) -> report. Everything lives under
`AutoRLConfig.out`: `inputs.jsonl` (+ `inputs.meta.json`), `checkpoints/` (the model),
`history.jsonl` and `loop.json` (the loop), `eval.json`, `reward.png`, `report.md`, `run.json`.
Running the same call again resumes: the inputs are read back, the model resumes from its
checkpoint and the loop from its data position; a finished run only rewrites its report.

The default judge and generator are the model's own server at step 0 (its base weights) with
constrained JSON: it needs no key and no network, but a 135M model is a weak judge and a weak
generator. Point `judge=`/`generator=` at a stronger model for real results.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from art_core import TrainableModel, TrainConfig, Trajectory
from art_core.atomic import atomic_write_bytes
from autorl.head_to_head import HeadToHead, head_to_head
from autorl.inputs import (
    InputItem,
    InputSet,
    generate_inputs,
    load_inputs,
    save_inputs,
    write_system_prompt,
)
from autorl.judge import JudgeConfig
from autorl.judging import JudgingMode, RulerConfig
from autorl.loop import LoopConfig, read_history, train_loop
from autorl.report import write_report
from autorl.rollout import chat_rollout
from autorl.ruler import DEFAULT_RUBRIC, ruler_score_group
from autorl.structured import Endpoint

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
WEAK_DEFAULT_NOTE = (
    "The judge and the input generator are the 135M model itself (its own server, constrained JSON): "
    "a weak judge and a weak generator, so expect noisy scores and repetitive inputs. For real results "
    "point them at a stronger model: --judge openai/gpt-4.1-mini --generator openai/gpt-4.1-mini (any "
    "LiteLLM model string), or --judge-base-url http://host:port/v1 --judge NAME for any OpenAI-compatible server."
)
Event = Callable[[str, dict[str, Any]], None]
"""Progress events: ("inputs", {kept, n}), ("step", record), ("phase", {name}), ("note", {text})."""


class RunMismatchError(ValueError):
    """The output folder holds a run of another task or model; the message says what to do."""


@dataclass(frozen=True)
class AutoRLConfig:
    """Everything a run does besides the task, the model and the endpoints."""

    out: Path = Path("autorl-run")
    """The run's folder (inputs, checkpoints, history, report); the same folder resumes the run."""
    steps: int = 6
    """Train until the model is at this step."""
    group_size: int = 4
    """Rollouts per input, ranked against each other by RULER."""
    groups_per_step: int = 2
    """Inputs per step."""
    num_inputs: int = 16
    """Inputs to generate (train + validation)."""
    min_inputs: int | None = None
    """Fewest distinct generated inputs accepted (default: three quarters of `num_inputs`)."""
    val_fraction: float = 0.25
    """Share of the inputs held out for the head-to-head evaluation."""
    max_tokens: int = 64
    """Tokens per reply of the trained model."""
    multi_turn: int = 0
    """Simulated-user turns after the first reply (0: single turn); the generator plays the user."""
    learning_rate: float = 1e-4
    """LoRA learning rate."""
    lora_rank: int = 16
    """LoRA rank (used when the model is created here)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    eval_temperature: float = 0.0
    """Sampling temperature of the head-to-head answers (0: greedy, so reruns agree)."""
    rubric: str | None = None
    """RULER's grading standards; default: the standard rubric plus the task description."""
    judge_mode: JudgingMode = "auto"
    """How RULER asks the judge (`autorl.RulerConfig.mode`): "auto" (probability-weighted for a
    local judge, sampled JSON for a remote one), "sampled", "weighted" or "pairwise"."""
    system_prompt: str | None = None
    """The trained model's system prompt; None lets the generator write one."""
    seed: int = 0
    """Seed of the split and of the data order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        for name in ("steps", "groups_per_step", "max_tokens", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (RULER ranks rollouts against each other), got {self.group_size}"
            )
        if self.num_inputs < 2:
            raise ValueError(f"num_inputs must be >= 2 (one train, one validation), got {self.num_inputs}")
        if self.multi_turn < 0:
            raise ValueError(f"multi_turn must be >= 0, got {self.multi_turn}")
        RulerConfig(mode=self.judge_mode)  # raises a ValueError naming the modes
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")


@dataclass(frozen=True)
class AutoRLResult:
    """What a run produced."""

    task: str
    out: Path
    inputs_train: int
    inputs_val: int
    steps: int
    """The model's step at the end."""
    seconds: float
    """Wall time of this call."""
    first_reward: float | None
    """Mean RULER score of the first steps (up to 3)."""
    last_reward: float | None
    """Mean RULER score of the last steps (up to 3)."""
    head_to_head: HeadToHead
    judge_errors: int
    """Failed judgements: training groups RULER could not score, plus head-to-head judgements."""
    history: list[dict[str, Any]] = field(default_factory=list)
    report: Path | None = None
    plot: Path | None = None

    @property
    def win_rate(self) -> float | None:
        return self.head_to_head.win_rate

    def summary(self) -> dict[str, Any]:
        """The `--json` fields."""
        h = self.head_to_head
        return {
            "task": self.task,
            "inputs_train": self.inputs_train,
            "inputs_val": self.inputs_val,
            "steps": self.steps,
            "seconds": round(self.seconds, 1),
            "first_reward": self.first_reward,
            "last_reward": self.last_reward,
            "win_rate": h.win_rate,
            "win_rate_ci": [h.ci_low, h.ci_high],
            "judge_errors": self.judge_errors,
        }


def as_endpoint(
    value: Endpoint | None, own: JudgeConfig, *, temperature: float, max_tokens: int | None = None
) -> JudgeConfig:
    """A JudgeConfig from a model string, a config, or None (the model's own server)."""
    if value is None:
        return replace(own, temperature=temperature, max_tokens=max_tokens or own.max_tokens)
    if isinstance(value, str):
        return JudgeConfig(model=value, temperature=temperature)
    return value


def own_server(model: TrainableModel) -> JudgeConfig:
    """The model's own server at step 0 (its base weights), constrained to JSON answers."""
    return JudgeConfig(
        model=model.get_inference_name(0),
        base_url=model.inference_base_url,
        api_key=model.inference_api_key,
        max_tokens=512,
        cache=False,
        explanation_max_chars=160,
    )


def task_rubric(task: str) -> str:
    """RULER's standard rubric plus the task, which the judge would otherwise see only through the system prompt."""
    return f"{DEFAULT_RUBRIC}\n- The assistant's task is: {task.strip()} Judge how well each trajectory does this task."


def _write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=1, ensure_ascii=False, default=str) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def check_run(out: Path, task: str, base_model: str) -> None:
    """Record the run's task and model in `run.json`, or refuse a folder holding another run."""
    path = out / "run.json"
    if path.is_file():
        run = json.loads(path.read_text(encoding="utf-8"))
        if run.get("task") != task or run.get("base_model") != base_model:
            raise RunMismatchError(
                f"{out} holds a run of task {run.get('task')!r} on {run.get('base_model')!r}; "
                f"pass another --out for {task!r} on {base_model!r}, or delete {out} to start over"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    _write_json(path, {"task": task, "base_model": base_model})


async def prepare_inputs(
    task: str, config: AutoRLConfig, generator: JudgeConfig, inputs: Path | InputSet | None, emit: Event
) -> InputSet:
    """The run's inputs: given, saved by an earlier run, or generated now; saved under `out`."""
    saved = config.out / "inputs.jsonl"
    if isinstance(inputs, InputSet):
        found: InputSet | None = inputs
    elif inputs is not None:
        found = load_inputs(inputs, task=task, val_fraction=config.val_fraction, seed=config.seed)
    elif saved.is_file():
        found = load_inputs(saved, task=task, val_fraction=config.val_fraction, seed=config.seed)
        emit("note", {"text": f"reusing the {len(found.items)} inputs saved in {saved}"})
    else:
        found = None
    if found is None:
        emit("phase", {"name": "generating inputs"})
        min_inputs = config.min_inputs or max(2, (3 * config.num_inputs + 3) // 4)
        found = await generate_inputs(
            task,
            config.num_inputs,
            generator=generator,
            val_fraction=config.val_fraction,
            seed=config.seed,
            system_prompt=config.system_prompt,
            min_inputs=min_inputs,
            on_batch=lambda kept, n: emit("inputs", {"kept": kept, "n": n}),
        )
    if config.system_prompt is not None and found.system_prompt != config.system_prompt:
        found = replace(found, system_prompt=config.system_prompt)
    if found.system_prompt is None:
        emit("phase", {"name": "writing a system prompt"})
        prompt, fell_back = await write_system_prompt(task, generator)
        found = replace(
            found, system_prompt=prompt, stats={**found.stats, "system_prompt_fallbacks": int(fell_back)}
        )
    if found.stats.get("system_prompt_fallbacks") and config.system_prompt is None:
        emit("note", {"text": f"the generator wrote no valid system prompt; using {found.system_prompt!r}"})
    found = replace(found, task=task)
    save_inputs(saved, found)
    return found


async def evaluate(
    model: TrainableModel,
    inputs: InputSet,
    config: AutoRLConfig,
    judge: JudgeConfig,
    user: JudgeConfig,
    rubric: str,
) -> tuple[HeadToHead, list[dict[str, str]]]:
    """Trained vs step-0 answers to every validation input, judged in both orders."""
    import asyncio

    system = inputs.system_prompt or ""

    async def answer(item: InputItem, step: int | None) -> Trajectory:
        return await chat_rollout(
            model,
            item,
            system_prompt=system,
            task=inputs.task,
            max_tokens=config.max_tokens,
            temperature=config.eval_temperature,
            step=step,
            user_turns=config.multi_turn,
            user=user,
        )

    val = inputs.val
    trained = await asyncio.gather(*(answer(i, None) for i in val))
    baseline = await asyncio.gather(*(answer(i, 0) for i in val))
    prompts = [t.messages[:2] for t in trained]
    result = await head_to_head(
        prompts,
        [t.messages[2:] for t in trained],
        [t.messages[2:] for t in baseline],
        judge=judge,
        rubric=rubric,
        ruler_config=RulerConfig(mode=config.judge_mode),
    )
    examples = [
        {
            "input": i.text,
            "trained": t.messages[2].get("content") or "",
            "baseline": b.messages[2].get("content") or "",
        }
        for i, t, b in zip(val, trained, baseline, strict=True)
    ]
    return result, examples


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


async def train(
    task: str,
    model: str | TrainableModel = DEFAULT_MODEL,
    *,
    judge: Endpoint | None = None,
    generator: Endpoint | None = None,
    inputs: Path | str | InputSet | None = None,
    config: AutoRLConfig | None = None,
    on_event: Event | None = None,
    **overrides: Any,
) -> AutoRLResult:
    """Train `model` on `task` from nothing but its description; see the module docstring.

    `model` is a base model name (alias, folder, .gguf; created under `out/checkpoints`) or a
    registered `TrainableModel`. `judge`/`generator`: a LiteLLM model string, a `JudgeConfig`
    (e.g. with `base_url`), or None for the model's own server. `overrides` replace fields of
    `config` (e.g. `steps=10, out="run"`).
    """
    started = time.perf_counter()
    if not task.strip():
        raise ValueError("the task description is empty: describe the task in a sentence or two")
    config = replace(config or AutoRLConfig(), **overrides)
    emit: Event = on_event or (lambda kind, data: None)
    backend = None
    if isinstance(model, str):
        from art_core.backends import LocalBackend

        check_run(config.out, task, model)
        trainable = TrainableModel(
            project="autorl", name="agent", base_model=model, lora_rank=config.lora_rank
        )
        backend = LocalBackend(config.out / "checkpoints")
        emit("phase", {"name": f"loading {model}"})
        await trainable.register(backend)
    else:
        trainable = model
        check_run(config.out, task, trainable.base_model)
    try:
        return await _run(task, trainable, judge, generator, inputs, config, emit, started)
    finally:
        if backend is not None:
            await backend.close()


async def _run(
    task: str,
    model: TrainableModel,
    judge_value: Endpoint | None,
    generator_value: Endpoint | None,
    inputs_value: Path | str | InputSet | None,
    config: AutoRLConfig,
    emit: Event,
    started: float,
) -> AutoRLResult:
    own = own_server(model)
    judge = as_endpoint(judge_value, own, temperature=0.0)
    generator = as_endpoint(generator_value, own, temperature=0.7, max_tokens=1024)
    notes = [WEAK_DEFAULT_NOTE] if judge_value is None or generator_value is None else []
    for note in notes:
        emit("note", {"text": note})
    source = Path(inputs_value) if isinstance(inputs_value, str) else inputs_value
    inputs = await prepare_inputs(task, config, generator, source, emit)
    rubric = config.rubric or task_rubric(task)
    system = inputs.system_prompt or ""

    async def rollout(item: InputItem) -> Trajectory:
        return await chat_rollout(
            model, item, system_prompt=system, task=task, max_tokens=config.max_tokens,
            temperature=config.temperature, user_turns=config.multi_turn, user=generator,
        )  # fmt: skip

    async def score(group: Any) -> Any:
        return await ruler_score_group(
            group, judge, rubric, on_error="count", config=RulerConfig(mode=config.judge_mode)
        )

    loop_config = LoopConfig(
        steps=config.steps,
        groups_per_step=config.groups_per_step,
        group_size=config.group_size,
        seed=config.seed,
        train=TrainConfig(learning_rate=config.learning_rate),
    )
    emit("phase", {"name": "training"})
    history = await train_loop(
        model, inputs.train, rollout=rollout, score=score, config=loop_config, state_dir=config.out,
        item_id=lambda i: i.id, on_step=lambda r: emit("step", r),
    )  # fmt: skip
    step = await model.get_step()
    h2h, examples = await _evaluation(model, inputs, config, judge, generator, rubric, step, emit)
    rewards = [r["reward"] for r in history if r.get("reward") is not None]
    result = AutoRLResult(
        task=task,
        out=config.out,
        inputs_train=len(inputs.train),
        inputs_val=len(inputs.val),
        steps=step,
        seconds=time.perf_counter() - started,
        first_reward=_mean(rewards[:3]),
        last_reward=_mean(rewards[-3:]),
        head_to_head=h2h,
        judge_errors=sum(int(r.get("judge_errors", 0)) for r in history) + h2h.judge_errors,
        history=history,
    )
    untrained = sum(1 for r in history if not r.get("trained"))
    if untrained:
        notes.append(
            f"{untrained} of {len(history)} steps trained nothing (see the warnings in history.jsonl)"
        )
    report, plot = write_report(config.out, result.summary(), history, notes=notes, examples=examples)
    return replace(result, report=report, plot=plot)


async def _evaluation(
    model: TrainableModel,
    inputs: InputSet,
    config: AutoRLConfig,
    judge: JudgeConfig,
    user: JudgeConfig,
    rubric: str,
    step: int,
    emit: Event,
) -> tuple[HeadToHead, list[dict[str, str]]]:
    """The saved evaluation of this step, or a new one (saved to `eval.json`)."""
    path = config.out / "eval.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("step") == step:
            h = saved["head_to_head"]
            h["outcomes"] = tuple(h.get("outcomes", ()))
            return HeadToHead(**h), saved.get("examples", [])
    emit("phase", {"name": "head-to-head evaluation"})
    h2h, examples = await evaluate(model, inputs, config, judge, user, rubric)
    _write_json(path, {"step": step, "head_to_head": asdict(h2h), "examples": examples})
    return h2h, examples


async def make_inputs(
    task: str,
    model: str = DEFAULT_MODEL,
    *,
    generator: Endpoint | None = None,
    config: AutoRLConfig | None = None,
    on_event: Event | None = None,
    **overrides: Any,
) -> InputSet:
    """Generate and save the inputs of a run (`out/inputs.jsonl`), as `train` would, without training.

    With no `generator`, `model` is loaded (under `out/checkpoints`, where `train` finds it) and
    its own server writes them. Inputs already saved in `out` are kept.
    """
    if not task.strip():
        raise ValueError("the task description is empty: describe the task in a sentence or two")
    config = replace(config or AutoRLConfig(), **overrides)
    emit: Event = on_event or (lambda kind, data: None)
    check_run(config.out, task, model)
    if generator is not None:
        return await prepare_inputs(
            task, config, as_endpoint(generator, _NO_SERVER, temperature=0.7), None, emit
        )
    from art_core.backends import LocalBackend

    trainable = TrainableModel(project="autorl", name="agent", base_model=model, lora_rank=config.lora_rank)
    backend = LocalBackend(config.out / "checkpoints")
    try:
        emit("phase", {"name": f"loading {model}"})
        await trainable.register(backend)
        emit("note", {"text": WEAK_DEFAULT_NOTE})
        return await prepare_inputs(
            task,
            config,
            as_endpoint(None, own_server(trainable), temperature=0.7, max_tokens=1024),
            None,
            emit,
        )
    finally:
        await backend.close()


_NO_SERVER = JudgeConfig(model="unused")


def load_history(out: Path) -> list[dict[str, Any]]:
    """The history of the run in `out`."""
    return read_history(Path(out) / "history.jsonl")


__all__ = ["AutoRLConfig", "AutoRLResult", "RunMismatchError", "WEAK_DEFAULT_NOTE", "make_inputs", "train"]
