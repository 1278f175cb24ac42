"""The `autorl` command: `autorl train "TASK"` trains a model from a task description alone;
`autorl inputs "TASK"` only generates and saves its inputs. A thin shell over `autorl.train`
and `autorl.pipeline.make_inputs`."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from autorl.judge import JudgeConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="AutoRL: train a model from nothing but a task description (inputs invented, RULER judges).",
)
console = Console(stderr=True)

ModelOpt = Annotated[
    str,
    typer.Option(
        help="The model to train: smollm2-135m (embedded), an HF folder, a .gguf file or a cached hub id."
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        help="The run's folder: inputs, checkpoints, history, reward.png, report.md. Rerun to resume."
    ),
]
GeneratorOpt = Annotated[
    str | None,
    typer.Option(
        help="Who writes the inputs, the system prompt and (with --multi-turn) the simulated user: a LiteLLM model "
        "string (e.g. openai/gpt-4.1-mini), or the model name at --generator-base-url. Default: the trained model's "
        "own server at step 0 with constrained JSON (a weak 135M generator).",
        show_default=False,
    ),
]
GeneratorUrlOpt = Annotated[
    str | None,
    typer.Option(
        help="OpenAI-compatible base URL (ending in /v1) of the generator; needs --generator NAME.",
        show_default=False,
    ),
]
GeneratorKeyOpt = Annotated[
    str | None, typer.Option(help="API key for --generator-base-url.", show_default=False)
]
NumInputsOpt = Annotated[int, typer.Option(min=2, help="Inputs to generate (train + validation).")]


def endpoint(
    name: str | None, base_url: str | None, api_key: str | None, flag: str
) -> JudgeConfig | str | None:
    """A JudgeConfig for `--FLAG-base-url`, the plain model string, or None (the model's own server)."""
    from autorl.judge import JudgeConfig

    if base_url is None:
        if api_key is not None and name is None:
            raise typer.BadParameter(
                f"--{flag}-api-key needs --{flag} (a LiteLLM model) or --{flag}-base-url"
            )
        return name if api_key is None or name is None else JudgeConfig(model=name, api_key=api_key)
    if name is None:
        raise typer.BadParameter(f"--{flag}-base-url needs --{flag} NAME: the model's name at that server")
    return JudgeConfig(model=name, base_url=base_url, api_key=api_key, max_tokens=1024)


@app.command()
def train(
    task: Annotated[
        str,
        typer.Argument(
            help='The task in a sentence or two, e.g. "Rewrite the user\'s text in formal English."'
        ),
    ],
    model: ModelOpt = "smollm2-135m",
    judge: Annotated[
        str | None,
        typer.Option(
            help="Who judges (RULER, and the head-to-head): a LiteLLM model string (e.g. openai/gpt-4.1-mini, "
            "ollama/qwen2.5:7b), or the model name at --judge-base-url. Default: the trained model's own server at "
            "step 0 with constrained JSON (a weak 135M judge).",
            show_default=False,
        ),
    ] = None,
    judge_base_url: Annotated[
        str | None,
        typer.Option(
            help="OpenAI-compatible base URL (ending in /v1) of the judge; needs --judge NAME.",
            show_default=False,
        ),
    ] = None,
    judge_api_key: Annotated[
        str | None, typer.Option(help="API key for --judge-base-url.", show_default=False)
    ] = None,
    judge_mode: Annotated[
        str,
        typer.Option(
            help="How RULER asks the judge: auto (probability-weighted for a local judge, sampled JSON "
            "for a remote one), sampled, weighted or pairwise.",
        ),
    ] = "auto",
    generator: GeneratorOpt = None,
    generator_base_url: GeneratorUrlOpt = None,
    generator_api_key: GeneratorKeyOpt = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            help='Inputs JSONL to use instead of generating (one {"input": ...} per line; "id" and "split" optional), '
            "e.g. a hand-edited inputs.jsonl of `autorl inputs`.",
            show_default=False,
        ),
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Train until the model is at this step.")] = 6,
    group_size: Annotated[
        int, typer.Option(min=2, help="Rollouts per input, ranked against each other by RULER.")
    ] = 4,
    groups_per_step: Annotated[int, typer.Option(min=1, help="Inputs (groups) per step.")] = 2,
    num_inputs: NumInputsOpt = 16,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per reply of the trained model.")] = 64,
    multi_turn: Annotated[
        int,
        typer.Option(
            min=0,
            help="Simulated-user turns after the first reply (the generator plays the user); 0: single turn.",
        ),
    ] = 0,
    learning_rate: Annotated[float, typer.Option(help="LoRA learning rate.")] = 1e-4,
    system_prompt: Annotated[
        str | None,
        typer.Option(
            help="The trained model's system prompt (default: the generator writes one).", show_default=False
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the train/validation split and the data order.")] = 0,
    out: OutOpt = Path("autorl-run"),
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="End with one JSON line: task, inputs, steps, rewards, win rate, judge errors."
        ),
    ] = False,
) -> None:
    """Invent inputs for TASK, train with RULER as the reward, and score the result against step 0.

    Rerunning the same command resumes an interrupted run: the inputs are reused, the model
    resumes from its checkpoint and the data position continues.
    """
    from autorl.pipeline import AutoRLConfig
    from autorl.pipeline import train as run_train

    _quiet_logs()
    judge_endpoint = endpoint(judge, judge_base_url, judge_api_key, "judge")
    generator_endpoint = endpoint(generator, generator_base_url, generator_api_key, "generator")
    try:
        config = AutoRLConfig(
            out=out, steps=steps, group_size=group_size, groups_per_step=groups_per_step, num_inputs=num_inputs,
            max_tokens=max_tokens, multi_turn=multi_turn, learning_rate=learning_rate, system_prompt=system_prompt, seed=seed,
            judge_mode=judge_mode,  # type: ignore[arg-type]  # checked by AutoRLConfig
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    with _progress(steps) as (progress, on_event):
        result = _run_or_exit(
            run_train(
                task,
                model,
                judge=judge_endpoint,
                generator=generator_endpoint,
                inputs=inputs,
                config=config,
                on_event=on_event,
            )
        )
        progress.stop()
    summary = result.summary()
    rate, ci = summary["win_rate"], summary["win_rate_ci"]
    shown = "n/a" if rate is None else f"{rate:.0%} (95% CI {ci[0]:.0%}-{ci[1]:.0%})"
    console.print(
        f"[bold]win rate vs step 0: {shown}[/bold] on {summary['inputs_val']} validation inputs; mean RULER score "
        f"{_num(summary['first_reward'])} -> {_num(summary['last_reward'])}; {summary['judge_errors']} judge errors; "
        f"{summary['steps']} steps in {summary['seconds']:.0f} s.\nReport: {result.report}; curve: {result.plot}",
        soft_wrap=True,
    )
    if as_json:
        print(json.dumps(summary))


@app.command()
def inputs(
    task: Annotated[str, typer.Argument(help="The task in a sentence or two.")],
    model: ModelOpt = "smollm2-135m",
    generator: GeneratorOpt = None,
    generator_base_url: GeneratorUrlOpt = None,
    generator_api_key: GeneratorKeyOpt = None,
    num_inputs: NumInputsOpt = 16,
    system_prompt: Annotated[
        str | None, typer.Option(help="Use this system prompt instead of generating one.", show_default=False)
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the train/validation split.")] = 0,
    out: OutOpt = Path("autorl-run"),
) -> None:
    """Only generate and save the inputs of TASK (OUT/inputs.jsonl); edit them, then run `autorl train`."""
    from autorl.pipeline import AutoRLConfig, make_inputs

    _quiet_logs()
    config = AutoRLConfig(out=out, num_inputs=num_inputs, system_prompt=system_prompt, seed=seed)
    gen = endpoint(generator, generator_base_url, generator_api_key, "generator")
    with _progress(None) as (progress, on_event):
        found = _run_or_exit(make_inputs(task, model, generator=gen, config=config, on_event=on_event))
        progress.stop()
    console.print(
        f"{len(found.train)} train and {len(found.val)} validation inputs in {out / 'inputs.jsonl'}; "
        f"system prompt: {escape(repr(found.system_prompt))}",
        soft_wrap=True,
    )


class _progress:
    """A rich progress bar fed by pipeline events; yields (progress, on_event)."""

    def __init__(self, steps: int | None) -> None:
        self.progress = Progress(
            TextColumn("[bold]autorl"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), console=console,
        )  # fmt: skip
        self.steps = steps
        self.task = self.progress.add_task("starting…", total=None)

    def __enter__(self) -> tuple[Progress, Any]:
        self.progress.start()
        return self.progress, self.on_event

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "note":
            self.progress.console.print(f"[yellow]note:[/yellow] {escape(data['text'])}", soft_wrap=True)
        elif kind == "phase":
            total = self.steps if data["name"] == "training" else None
            self.progress.reset(self.task, total=total, description=data["name"])
        elif kind == "inputs":
            self.progress.update(
                self.task, description="generating inputs", total=data["n"], completed=data["kept"]
            )
        elif kind == "step":
            reward = data.get("reward")
            shown = "-" if reward is None else f"{reward:.2f}"
            self.progress.update(
                self.task,
                completed=data["step"],
                description=f"step {data['step']}: RULER {shown}, judge errors {data['judge_errors']}",
            )


def _run_or_exit(coro: Any) -> Any:
    from autorl.inputs import InputFileError, TooFewInputsError
    from autorl.pipeline import RunMismatchError
    from autorl.structured import StructuredOutputError

    try:
        return asyncio.run(coro)
    except (TooFewInputsError, InputFileError, RunMismatchError, StructuredOutputError, ValueError) as exc:
        console.print(f"[red]autorl: {type(exc).__name__}:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _quiet_logs() -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[RichHandler(console=console)])
    # (not art_core's loggers: their warnings, such as a step that trained nothing, must show)
    for noisy in ("httpx", "transformers", "peft", "uvicorn", "uvicorn.access", "LiteLLM"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
