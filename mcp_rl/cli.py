"""The `mcp-rl` command: `mcp-rl train` teaches a model to use an MCP server's tools; `mcp-rl
scenarios` only writes the scenario file."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Train a model to use the tools of any MCP server."
)
console = Console(stderr=True)

Server = Annotated[
    str | None,
    typer.Option(
        "--server",
        help='A stdio server command line, e.g. "mcp-server-time --local-timezone UTC"; {workdir} in it names the process\'s copy of --workdir.',
    ),
]
Url = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="A streamable-HTTP server endpoint, e.g. http://127.0.0.1:8000/mcp (instead of --server).",
    ),
]
Env = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="KEY=VALUE for a stdio server (repeatable); stdio servers inherit only HOME, PATH, SHELL, TERM, USER, LOGNAME.",
    ),
]
Header = Annotated[
    list[str] | None,
    typer.Option(
        "--header",
        help='"Name: value" sent to a --url server (repeatable), e.g. "Authorization: Bearer TOKEN".',
    ),
]
Workdir = Annotated[
    Path | None,
    typer.Option("--workdir", help="A folder copied to each stdio server process as its working directory."),
]
Mode = Annotated[
    str,
    typer.Option(
        "--mode",
        help='Protocol negotiation: "auto" (2026 discover, falls back to initialize) or "legacy" (initialize only; quieter with 1.x servers).',
    ),
]
Out = Annotated[
    Path,
    typer.Option(
        "--out",
        help="Folder for everything the run writes (server log, scenarios, model, report); running again resumes.",
    ),
]
Model = Annotated[
    str,
    typer.Option(
        "--model",
        help="Base model to train: alias (smollm2-135m, tiny-random), HF folder, .gguf file or cached hub id.",
    ),
]
Generator = Annotated[
    str,
    typer.Option(
        "--generator",
        help='Scenario writer: "local" (the starting model on our own server) or a LiteLLM model string (openai/gpt-4.1-mini, ...).',
    ),
]
Judge = Annotated[
    str,
    typer.Option(
        "--judge",
        help='RULER judge: "local", "none" (score by the scenarios\' checks alone) or a LiteLLM model string.',
    ),
]
Scenarios = Annotated[
    Path | None,
    typer.Option(
        "--scenarios",
        help="Scenario JSONL to use; written there first when it does not exist (default: OUT/scenarios.jsonl).",
    ),
]
NScenarios = Annotated[
    int, typer.Option("--n-scenarios", help="Scenarios to generate when there is no scenario file.")
]
MaxTurns = Annotated[
    int,
    typer.Option(
        "--max-turns", help="Chat completions per rollout; the agent must call complete_task before."
    ),
]
Isolation = Annotated[
    str,
    typer.Option(
        "--isolation",
        help='"per-rollout" (default: own server process and workdir copy per rollout, so stateful servers start each rollout alike) or "shared" (one server for all).',
    ),
]
ToolTimeout = Annotated[
    float,
    typer.Option(
        "--tool-timeout",
        help="Seconds a tool call may take; then a server that answers no ping is restarted and the rollout fails.",
    ),
]
MaxOutput = Annotated[
    int,
    typer.Option(
        "--max-tool-output",
        help="Characters of a tool result the model sees; longer ones are cut with a visible marker.",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="End with a one-line JSON summary on stdout.")]


def _spec(
    server: str | None,
    url: str | None,
    env: list[str] | None,
    header: list[str] | None,
    workdir: Path | None,
    mode: str,
) -> Any:
    from mcp_rl.server_spec import ServerSpecError, spec_from_cli

    try:
        return spec_from_cli(
            server=server,
            url=url,
            env=env or [],
            headers=header or [],
            workdir=workdir,
            mode=mode,  # type: ignore[arg-type]
        )  # type: ignore[arg-type]
    except ServerSpecError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _quiet() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "LiteLLM", "mcp", "art_core"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _show(event: str, data: dict[str, Any]) -> None:
    if event == "catalog":
        console.print(
            f"server tools: {', '.join(data['tools'])}; {data['resources']} resources, {data['prompts']} prompts"
        )
    elif event == "scenarios":
        console.print(f"scenarios: {data['train']} train, {data['val']} val")
    elif event == "eval":
        failed = data["exceptions"] + data["server_failures"]
        lost = (
            f" ({data['exceptions']} raised, {data['server_failures']} server failures; see the log)"
            if failed
            else ""
        )
        console.print(
            f"validation {data['when']}: {data['rollouts']} rollouts{lost}, success {data['success_rate']}, "
            f"completed {data['completed_rate']:.2f}, turns {data['mean_turns']:.2f}"
        )
    elif event == "step":
        reward = "n/a" if data["reward"] is None else f"{data['reward']:.3f}"
        console.print(
            f"step {data['step']}: reward {reward}, trained {data['trained']}, groups scored "
            f"{data['groups_scored']}/{data['groups']}, judge errors {data['judge_errors']}, "
            f"server failures so far {data['server_failures']}, {data['step_s']:.0f} s"
        )


@app.command()
def train(
    server: Server = None, url: Url = None, env: Env = None, header: Header = None, workdir: Workdir = None,
    mode: Mode = "auto",
    model: Model = "smollm2-135m",
    judge: Judge = "local",
    generator: Generator = "local",
    steps: Annotated[int, typer.Option("--steps", help="Training steps in all (a resumed run continues up to this many).")] = 5,
    group_size: Annotated[int, typer.Option("--group-size", help="Rollouts per scenario, compared with each other by GRPO.")] = 4,
    groups_per_step: Annotated[int, typer.Option("--groups-per-step", help="Scenarios per training step.")] = 2,
    scenarios: Scenarios = None,
    n_scenarios: NScenarios = 16,
    max_turns: MaxTurns = 3,
    isolation: Isolation = "per-rollout",
    tool_timeout: ToolTimeout = 30.0,
    max_tool_output: MaxOutput = 4000,
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="LoRA learning rate.")] = 1e-3,
    val_rollouts: Annotated[int, typer.Option("--val-rollouts", help="Rollouts per validation scenario, before and after.")] = 2,
    check_weight: Annotated[float, typer.Option("--check-weight", help="Weight of a scenario's shaped check vs RULER in the reward (> 2/3: a passing answer always outranks a failing one; see mcp_rl.rewards).")] = 0.7,
    name: Annotated[str, typer.Option("--name", help="The trained model's name (resumes if it exists under OUT).")] = "agent",
    out: Out = Path("mcp-rl-out"),
    as_json: AsJson = False,
) -> None:  # fmt: skip
    """Connect to an MCP server, write or load scenarios, train with GRPO, report before and after."""
    from mcp_rl.agent import AgentConfig
    from mcp_rl.connection import ServerStartError
    from mcp_rl.evaluation import EvaluationError
    from mcp_rl.pipeline import RunConfig, run
    from mcp_rl.scenarios import ScenarioFileError
    from mcp_rl.toolbox import ToolCallConfig

    _quiet()
    spec = _spec(server, url, env, header, workdir, mode)
    try:
        config = RunConfig(
            server=spec, out=out, model=model, name=name, judge=judge, generator=generator, scenarios=scenarios,
            n_scenarios=n_scenarios, steps=steps, groups_per_step=groups_per_step, group_size=group_size,
            learning_rate=learning_rate, check_weight=check_weight, val_rollouts=val_rollouts,
            isolation=isolation,  # type: ignore[arg-type]
            agent=AgentConfig(max_turns=max_turns),
            tools=ToolCallConfig(timeout_s=tool_timeout, max_output_chars=max_tool_output),
        )  # fmt: skip
        summary = asyncio.run(run(config, on_event=_show))
    except (ValueError, ServerStartError, ScenarioFileError, EvaluationError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(f"report: {out / 'report.md'}")
    if as_json:
        print(json.dumps(summary))


@app.command("scenarios")
def scenarios_command(
    server: Server = None, url: Url = None, env: Env = None, header: Header = None, workdir: Workdir = None,
    mode: Mode = "auto",
    generator: Generator = "local",
    model: Annotated[str, typer.Option("--model", help='The model served for "local" generation and for the solvability attempts.')] = "smollm2-135m",
    n: Annotated[int, typer.Option("--n", help="Scenarios to write.")] = 16,
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Share held out for validation.")] = 0.25,
    attempts: Annotated[int, typer.Option("--attempts", help="Attempts per scenario in the solvability filter (0: skip).")] = 2,
    drop_unsolvable: Annotated[bool, typer.Option("--drop-unsolvable", help="Drop scenarios no attempt solved (default: keep them, marked solvable=false).")] = False,
    max_turns: MaxTurns = 3,
    output: Annotated[Path, typer.Option("--output", help="The scenario JSONL to write (pass it to train --scenarios).")] = Path("scenarios.jsonl"),
) -> None:  # fmt: skip
    """Only write scenarios: generated from the server's tools, de-duplicated, checked, split."""
    from mcp_rl.agent import AgentConfig
    from mcp_rl.connection import ServerStartError
    from mcp_rl.generation import TooFewScenariosError
    from mcp_rl.pipeline import RunConfig, prepare_scenarios_only

    _quiet()
    spec = _spec(server, url, env, header, workdir, mode)
    if output.exists():
        console.print(f"[red]error:[/red] {output} exists; remove it or choose another --output")
        raise typer.Exit(2)
    try:
        config = RunConfig(
            server=spec, out=output.parent, model=model, generator=generator, scenarios=output, n_scenarios=n,
            val_fraction=val_fraction, solvability_attempts=attempts, agent=AgentConfig(max_turns=max_turns),
        )  # fmt: skip
        written = asyncio.run(prepare_scenarios_only(config, drop_unsolvable=drop_unsolvable))
    except (ValueError, ServerStartError, TooFewScenariosError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    unsolved = sum(s.solvable is False for s in written)
    console.print(f"wrote {len(written)} scenarios to {output} ({unsolved} marked unsolvable)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
