"""AutoRL end to end on CPU with real parts: our server, the tiny model, the real openai and
litellm clients; the `autorl` CLI; a real subprocess killed mid-run and resumed; a judge that
answers garbage (SCRIPTED); SmolLM2 in one slow test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from art_core.model import TrainableModel
from autorl import AutoRLConfig, RunMismatchError, load_inputs, train
from autorl.cli import app
from autorl.inputs import InputItem
from autorl.judge import JudgeConfig
from autorl.loop import read_history
from autorl.rollout import chat_rollout
from tests.helpers_scripted import scripted_server
from tests.helpers_serving import served_fixture

served = served_fixture("autorl-pipeline", project="autorl-pipeline", name="helper")

TASK = "Answer questions about fruit in one friendly sentence."
SUMMARY_KEYS = {
    "task", "inputs_train", "inputs_val", "steps", "seconds", "first_reward", "last_reward",
    "win_rate", "win_rate_ci", "judge_errors",
}  # fmt: skip
SMALL = ["--group-size", "2", "--groups-per-step", "1", "--num-inputs", "4", "--max-tokens", "6"]


def litellm_endpoint(model: TrainableModel, **settings: object) -> JudgeConfig:
    """The helper model's server at step 0, reached through LiteLLM's openai/ route."""
    extra = {"api_base": model.inference_base_url, "api_key": model.inference_api_key}
    return JudgeConfig(model=f"openai/{model.name}@0", extra_params=extra, cache=False, **settings)  # type: ignore[arg-type]


async def test_train_api_with_litellm_endpoints_multi_turn(model: TrainableModel, tmp_path: Path) -> None:
    out = tmp_path / "run"
    judge = litellm_endpoint(model, max_tokens=300, explanation_max_chars=40)
    generator = litellm_endpoint(model, temperature=1.0, max_tokens=800)
    config = AutoRLConfig(
        out=out, steps=2, group_size=2, groups_per_step=1, num_inputs=4, max_tokens=6, multi_turn=1
    )
    result = await train(TASK, "tiny-random", judge=judge, generator=generator, config=config)
    assert set(result.summary()) == SUMMARY_KEYS and result.steps == 2
    assert (result.inputs_train, result.inputs_val) == (3, 1)
    assert [r["step"] for r in result.history] == [1, 2]
    assert result.report is not None and "win" in result.report.read_text()
    assert "135M" not in result.report.read_text()  # both endpoints were given: no weak-default note
    inputs = load_inputs(out / "inputs.jsonl")
    assert inputs.system_prompt and len(inputs.items) == 4
    with pytest.raises(RunMismatchError, match="holds a run of task"):
        await train("Another task.", "tiny-random", judge=judge, generator=generator, config=config)


async def test_multi_turn_rollout_has_a_simulated_user(model: TrainableModel) -> None:
    user = litellm_endpoint(model, temperature=1.0, max_tokens=200)
    item = InputItem("x1", "train", "Which fruit is the sweetest?")
    trajectory = await chat_rollout(
        model, item, system_prompt="You sell fruit.", task=TASK, max_tokens=4, user_turns=2, user=user
    )
    roles = [m["role"] for m in trajectory.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in trajectory.messages if m["role"] == "user")


async def test_a_garbage_judge_is_counted_and_nothing_is_scored(tmp_path: Path) -> None:
    with scripted_server("judge") as scripted_judge:
        scripted_judge.responder = lambda body: "All of them are great!"
        inputs = tmp_path / "mine.jsonl"
        inputs.write_text(
            "".join(json.dumps({"input": f"What about fruit number {i}?"}) + "\n" for i in range(4))
        )
        result = await train(
            TASK, "tiny-random", judge=scripted_judge.config(), generator=scripted_judge.config(),
            inputs=inputs, out=tmp_path / "run", steps=2, group_size=2, groups_per_step=1, max_tokens=4,
            system_prompt="You sell fruit.", judge_mode="sampled",
        )  # fmt: skip
    assert result.steps == 2 and result.first_reward is None and result.judge_errors == 2
    # nothing trained, so the greedy answers of step 2 and step 0 are identical: a tie, no judge call
    assert result.head_to_head.outcomes == (0.5,) and result.head_to_head.judge_errors == 0
    assert all(not r["trained"] and r["judge_errors"] == 1 for r in result.history)
    assert "2 of 2 steps trained nothing" in (tmp_path / "run" / "report.md").read_text()


def test_cli_json_defaults_to_own_server_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", TASK, "--model", "tiny-random", "--steps", "2", *SMALL, "--out", str(out), "--json"]
    first = CliRunner().invoke(app, argv)
    assert first.exit_code == 0, first.output
    summary = json.loads(first.output.strip().splitlines()[-1])
    assert set(summary) == SUMMARY_KEYS and summary["steps"] == 2 and summary["task"] == TASK
    assert "135M model itself" in " ".join(first.output.split())
    assert (out / "reward.png").stat().st_size > 0 and (out / "report.md").is_file()
    again = CliRunner().invoke(app, [*argv[:5], "3", *argv[6:]])  # one more step on the same run
    assert again.exit_code == 0, again.output
    assert "reusing the 4 inputs" in " ".join(again.output.split())
    assert [r["step"] for r in read_history(out / "history.jsonl")] == [1, 2, 3]
    assert json.loads(again.output.strip().splitlines()[-1])["steps"] == 3


def test_cli_help_explains_every_flag() -> None:
    import typer

    for name in ("train", "inputs"):
        command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
        options = [p for p in command.params if p.param_type_name == "option"]
        assert options and all(len(p.help or "") > 10 for p in options), name
    train_options = {p.opts[0]: p.help for p in typer.main.get_command(app).commands["train"].params}  # type: ignore[attr-defined]
    for flag in ["--model", "--judge", "--judge-base-url", "--generator", "--generator-base-url", "--inputs",
                 "--steps", "--group-size", "--out", "--multi-turn", "--json"]:  # fmt: skip
        assert flag in train_options
    assert (
        "weak 135M judge" in train_options["--judge"]
        and "LiteLLM model string" in train_options["--generator"]
    )
    assert CliRunner().invoke(app, ["train", "--help"]).exit_code == 0


def test_cli_too_few_inputs_exits_2_with_the_reason(tmp_path: Path) -> None:
    with scripted_server("generator") as scripted_generator:
        scripted_generator.responder = lambda body: json.dumps({"items": [{"input": "same"}] * 4})
        argv = ["inputs", TASK, "--generator", scripted_generator.model, "--generator-base-url",
                scripted_generator.url, "--generator-api-key", "x", "--system-prompt", "Sell fruit.",
                "--out", str(tmp_path / "run")]  # fmt: skip
        result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2
    assert "TooFewInputsError" in result.output and "only 1 distinct items" in " ".join(result.output.split())


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "killed"


def test_killed_run_resumes_where_it_stopped(run_dir: Path) -> None:
    argv = [sys.executable, "-m", "autorl.cli", "train", TASK, "--model", "tiny-random", "--steps", "4", *SMALL,
            "--out", str(run_dir), "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    history = run_dir / "history.jsonl"
    deadline = time.monotonic() + 300
    while not (history.is_file() and read_history(history)) and process.poll() is None:
        assert time.monotonic() < deadline, "the first step did not finish in time"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    before = read_history(history)
    assert 1 <= len(before) < 4, "the run finished before it could be killed"
    inputs_before = (run_dir / "inputs.jsonl").read_bytes()
    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (run_dir / "inputs.jsonl").read_bytes() == inputs_before  # not regenerated
    after = read_history(history)
    assert [r["step"] for r in after] == [1, 2, 3, 4] and after[: len(before)] == before
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["steps"] == 4
    assert "reusing the 4 inputs" in " ".join(rerun.stderr.split())


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "smol"
    argv = ["train", TASK, "--steps", "1", "--group-size", "2", "--groups-per-step", "1", "--num-inputs", "4",
            "--max-tokens", "24", "--out", str(out), "--json"]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["inputs_train"] + summary["inputs_val"] >= 3
    assert load_inputs(out / "inputs.jsonl").system_prompt
