"""Every script in examples/ runs in tiny mode (tiny-random model, 1-2 steps) and does what it says."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from art_core.app.demo import DemoSummary

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_covered() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.py")} == {"fruit_stand", "ruler_one_step", "langgraph_agent"}


async def test_fruit_stand_trains_two_steps(tmp_path: Path) -> None:
    rewards = await load_example("fruit_stand").main("tiny-random", 2, 2, str(tmp_path))
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert (tmp_path / "examples" / "models" / "fruit-stand" / "model.json").exists()


@pytest.mark.parametrize("mode", ["auto", "sampled"])
def test_ruler_one_step_runs_with_its_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """Defaults: the tiny random model as its own judge. "auto" tries the weighted mode, finds no
    label probability and falls back to sampled JSON; "sampled" asks for the JSON directly. The
    schema names each reply once, so even a random judge's constrained answer is valid: exit 0."""
    code = load_example("ruler_one_step").main(["--judge-mode", mode, "--path", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "judge:" in out.out and out.out.count("reward=") == 4 and "trained step 1" in out.out
    assert "'judge_calls'" in out.out and "RULER failed" not in out.err


async def test_langgraph_agent_trains_two_steps(tmp_path: Path) -> None:
    example = load_example("langgraph_agent")
    summary = await example.main("tiny-random", 2, 2, str(tmp_path), groups_per_step=1, max_tokens=4)
    assert summary["steps"] == 2 and 0.0 <= summary["first_reward"] <= 1.0 and summary["seconds"] > 0
    assert (tmp_path / "examples" / "models" / "langgraph-agent" / "model.json").exists()


def test_langgraph_agent_json_summary_is_the_last_line(tmp_path: Path) -> None:
    argv = ["--base-model", "tiny-random", "--steps", "1", "--group-size", "2", "--groups-per-step", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "langgraph_agent.py"),
            *argv,
            "--max-tokens",
            "4",
            "--path",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    demo_fields = {f.name for f in dataclasses.fields(DemoSummary)} - {
        "rewards",
        "start_step",
        "step_seconds",
    }  # what `art demo --json` prints, less the demo's own time split
    assert set(summary) == demo_fields and summary["steps"] == 1


def test_langgraph_agent_reward() -> None:
    reward = load_example("langgraph_agent").reward
    question = HumanMessage("How much does a mango cost?")
    call = AIMessage("", tool_calls=[{"name": "get_price", "args": {"fruit": "Mango "}, "id": "c1"}])
    result = ToolMessage("$1.75 per pound", tool_call_id="c1")
    assert reward("mango", [question, call, result, AIMessage("A mango costs $1.75 per pound.")]) == 1.0
    assert reward("mango", [question, call, result, AIMessage("It costs $2.")]) == 0.5
    assert (
        reward("mango", [question, AIMessage("A mango costs $1.75 per pound.")]) == 0.0
    )  # a guess, no lookup
    wrong = AIMessage("", tool_calls=[{"name": "get_price", "args": {"fruit": "apple"}, "id": "c1"}])
    assert reward("mango", [question, wrong, result, AIMessage("$1.75")]) == 0.0
