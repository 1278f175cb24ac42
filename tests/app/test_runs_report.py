"""`art runs`, `art report` and `art trajectories` on a real stored run (tests/helpers_runs.py)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from typer.testing import CliRunner

from art_core.app.cli import app
from art_core.app.report import CURVES
from art_core.app.svg import polyline_chart
from tests.helpers_runs import MODEL, PROJECT, StoredRun, build_run, explanation, user_text

RUN = f"{PROJECT}/{MODEL}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StoredRun]:
    yield await build_run(tmp_path_factory.mktemp("runs"))


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_runs_lists_the_model_its_step_and_latest_metrics(run: StoredRun) -> None:
    code, out = invoke("runs", str(run.root))
    assert code == 0, out
    assert PROJECT in out and MODEL in out
    row = next(line for line in out.splitlines() if MODEL in line)
    assert re.search(r"\b2\b", row), row  # the latest step
    reward = [h for h in _history(run) if "trained" in h][-1]["train/reward"]
    assert f"{reward:.4g}" in row


def test_runs_json_parses_and_holds_the_history(run: StoredRun) -> None:
    code, out = invoke("runs", str(run.root), "--json")
    assert code == 0, out
    (entry,) = json.loads(out)
    assert (entry["project"], entry["model"], entry["latest_step"]) == (PROJECT, MODEL, 2)
    assert entry["history_steps"] == [1, 2]
    assert entry["latest"]["loss/grad_norm"] > 0 and "val/reward" in entry["latest"]


def test_runs_of_an_empty_folder_says_so(tmp_path: Path) -> None:
    code, out = invoke("runs", str(tmp_path))
    assert code == 0 and "no runs under" in out


def _history(run: StoredRun) -> list[dict[str, float]]:
    path = run.root / PROJECT / "models" / MODEL / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_report_is_one_html_file_with_curves_and_escaped_trajectories(run: StoredRun, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    code, text = invoke("report", RUN, "--path", str(run.root), "--out", str(out))
    assert code == 0, text
    page = out.read_text()
    assert page.count("<svg") == len(CURVES)
    assert page.count('class="series"') == len(CURVES)  # KL: one point, step 2 (step 1 has no KL term)
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    # step 1 (first) and 2 (last); the best of step 1 is group 0's 4th rollout (reward 1), escaped
    assert "train step 1" in page and "train step 2" in page
    assert html.escape(user_text(0, 3)) in page and user_text(0, 3) not in page
    # step 2's trajectories carry RULER's explanation in their logs
    best_of_two = max((t for g in run.groups[2] for t in g.trajectories), key=lambda t: t.reward or 0)
    assert best_of_two.logs and html.escape(best_of_two.logs[-1]) in page
    assert html.escape(explanation("4")) in page


def test_report_steps_option_chooses_the_steps(run: StoredRun, tmp_path: Path) -> None:
    out = tmp_path / "two.html"
    code, text = invoke("report", RUN, "--path", str(run.root), "--out", str(out), "--steps", "2")
    assert code == 0, text
    page = out.read_text()
    assert "train step 2" in page and "train step 1" not in page
    code, text = invoke("report", RUN, "--path", str(run.root), "--out", str(out), "--steps", "7")
    assert code == 2 and "no train trajectories for step 7" in text and "steps: 1, 2" in text


@pytest.mark.parametrize("name", ["../etc", "obs", "obs/../x", "obs/a b", "/abs/x"])
def test_bad_run_names_are_refused_with_advice(run: StoredRun, tmp_path: Path, name: str) -> None:
    for command in (
        ["report", name, "--out", str(tmp_path / "x.html")],
        ["trajectories", name, "--step", "1"],
    ):
        code, text = invoke(*command, "--path", str(run.root))
        assert code == 2, text
        assert "PROJECT/MODEL" in text or "invalid" in text
    assert not (tmp_path / "x.html").exists()


def test_a_missing_run_points_to_art_runs(run: StoredRun) -> None:
    code, text = invoke("trajectories", f"{PROJECT}/nobody", "--step", "1", "--path", str(run.root))
    assert code == 2 and "art runs" in text


def test_trajectories_best_and_worst(run: StoredRun) -> None:
    code, out = invoke("trajectories", RUN, "--step", "1", "--best", "1", "--path", str(run.root))
    assert code == 0, out
    assert user_text(0, 3) in out and "reward 1" in out and out.count("best 1") == 1
    assert user_text(0, 0) not in out
    code, out = invoke("trajectories", RUN, "--step", "1", "--worst", "2", "--path", str(run.root))
    assert code == 0, out
    assert user_text(0, 0) in out and user_text(1, 0) in out and user_text(0, 3) not in out


def test_trajectories_of_val_and_all_of_a_step(run: StoredRun) -> None:
    code, out = invoke("trajectories", RUN, "--step", "2", "--split", "val", "--path", str(run.root))
    assert code == 0, out
    assert "8 rewarded trajectories in 2 groups" in out
    code, out = invoke("trajectories", RUN, "--step", "2", "--path", str(run.root))
    assert code == 0 and explanation("4") in out  # the judge's explanation, from the trajectory's logs
    code, out = invoke(
        "trajectories", RUN, "--step", "1", "--best", "1", "--worst", "1", "--path", str(run.root)
    )
    assert code == 2 and "not both" in out


def test_polyline_chart_scales_points_and_escapes_its_title() -> None:
    svg = polyline_chart([(1, 0.0), (2, 1.0), (3, float("nan"))], "<loss> & co", width=100, height=100)
    (points,) = re.findall(r'class="series" points="([^"]+)"', svg)
    (x1, y1), (x2, y2) = (tuple(map(float, p.split(","))) for p in points.split())
    assert x1 < x2 and y1 > y2  # rising reward goes up the page
    assert "&lt;loss&gt; &amp; co" in svg and "<loss>" not in svg
    assert "no data" in polyline_chart([], "empty") and "series" not in polyline_chart([], "empty")
