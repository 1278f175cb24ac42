"""The run's report: `reward.png` (mean reward per step), `report.md` and `summary.json`.

Thin adapter for the contract's `autorl/report.py` (not on branch `autorl` yet).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plot_rewards(history: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Mean reward per step as a PNG; None when no step has a reward."""
    points = [(h["step"], h["reward"]) for h in history if h.get("reward") is not None]
    if not points:
        return None
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    _atomic_write(path, buffer.getvalue())
    return path


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _tool_table(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[str]:
    tools = sorted({*((before or {}).get("tools") or {}), *((after or {}).get("tools") or {})})
    lines = [
        "| tool | calls before | error rate before | calls after | error rate after |",
        "|---|---|---|---|---|",
    ]
    for tool in tools:
        b = ((before or {}).get("tools") or {}).get(tool, {})
        a = ((after or {}).get("tools") or {}).get(tool, {})
        lines.append(
            f"| {tool} | {_fmt(b.get('calls'))} | {_fmt(b.get('error_rate'))} | {_fmt(a.get('calls'))} | {_fmt(a.get('error_rate'))} |"
        )
    return lines


def write_report(
    out: Path, summary: dict[str, Any], details: dict[str, Any], history: list[dict[str, Any]]
) -> Path:
    """Write `summary.json`, `reward.png` (when there are rewards) and `report.md`; returns the report."""
    _atomic_write(out / "summary.json", json.dumps({**summary, "details": details}, indent=2).encode())
    png = plot_rewards(history, out / "reward.png", f"mcp-rl: {summary['server']}")
    before, after, duel = details.get("before"), details.get("after"), details.get("head_to_head")
    lines = [
        f"# mcp-rl report: `{summary['server']}`",
        "",
        f"{summary['steps']} steps in {summary['seconds']} s; scenarios {summary['scenarios_train']} train / "
        f"{summary['scenarios_val']} val; server restarts {summary['server_restarts']}; tool errors {summary['tool_errors']}.",
        "",
        "| validation | before | after |",
        "|---|---|---|",
        f"| success rate | {_fmt(summary['val_success_before'])} | {_fmt(summary['val_success_after'])} |",
        f"| completed with complete_task | {_fmt((before or {}).get('completed_rate'))} | {_fmt((after or {}).get('completed_rate'))} |",
        f"| mean turns | {_fmt((before or {}).get('mean_turns'))} | {_fmt((after or {}).get('mean_turns'))} |",
        "",
        f"Head-to-head (trained vs start, RULER in both orders): win rate {_fmt(summary['win_rate'])}"
        + (
            f" ({duel['wins']} wins, {duel['losses']} losses, {duel['ties']} ties, {duel['judge_errors']} judge errors)"
            if duel
            else ""
        ),
        "",
        *_tool_table(before, after),
        "",
        f"Reward: first {_fmt(summary['first_reward'])}, last {_fmt(summary['last_reward'])}"
        + (f" ({png.name})" if png else " (no step had a reward)"),
        "",
    ]
    path = out / "report.md"
    _atomic_write(path, "\n".join(lines).encode())
    return path


__all__ = ["plot_rewards", "write_report"]
