"""`art demo` as a newcomer runs it (on the tiny model): its JSON line, its plot, and a second run resuming."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from art_core.app.cli import app


def test_art_demo_json_line_plot_and_resume(tmp_path: Path) -> None:
    argv = [
        "demo",
        "--model",
        "tiny-random",
        "--steps",
        "2",
        "--group-size",
        "2",
        "--scenarios-per-step",
        "1",
    ]
    argv += [
        "--max-tokens",
        "4",
        "--path",
        str(tmp_path / ".art"),
        "--plot",
        str(tmp_path / "curve.png"),
        "--json",
    ]
    runner = CliRunner()
    first = runner.invoke(app, argv)
    assert first.exit_code == 0, first.output
    summary = json.loads(first.output.strip().splitlines()[-1])
    assert set(summary) == {"first_reward", "last_reward", "steps", "seconds", "step_seconds"}
    assert summary["steps"] == 2
    split = summary["step_seconds"]  # both steps' commits done: the last one's during close
    phases = {
        "rollout",
        "remerge",
        "train",
        "publish",
        "checkpoint",
        "checkpoint_wait",
        "checkpoint_overlapped",
    }
    assert phases <= set(split)
    assert 0 <= split["checkpoint_overlapped"] <= split["checkpoint"] and "per step: rollouts" in first.output
    # 0.0 where step 1 trained nothing (equal rewards: nothing to re-merge for step 2's rollouts)
    assert split["remerge"] >= 0 and "the served weights' re-merge" in " ".join(first.output.split())
    assert (tmp_path / "curve.png").stat().st_size > 0 and "resumed" not in first.output
    second = runner.invoke(app, argv)  # the same name again: the model resumes at step 2
    assert second.exit_code == 0, second.output
    assert "resumed at step 2" in second.output
    assert json.loads(second.output.strip().splitlines()[-1])["steps"] == 2


def test_art_serve_torch_engine_flags_are_refused_with_vllm(tmp_path: Path) -> None:
    for flags, named in [
        (["--prefix-cache-mib", "0"], "--prefix-cache-mib"),
        (["--max-queued-rows", "8", "--prefix-cache-mib", "64"], "--max-queued-rows, --prefix-cache-mib"),
    ]:
        result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--path", str(tmp_path), *flags])
        assert result.exit_code == 2, result.output
        assert f"{named} applies to the torch engine" in " ".join(result.output.split())
    negative = CliRunner().invoke(app, ["serve", "--path", str(tmp_path), "--prefix-cache-mib", "-1"])
    assert negative.exit_code == 2


def test_art_serve_refuses_a_body_limit_under_1_mib(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--path", str(tmp_path), "--max-body-mib", "0"])
    assert result.exit_code == 2 and "--max-body-mib" in result.output
