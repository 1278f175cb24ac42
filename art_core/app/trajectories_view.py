"""`art trajectories` and `art runs`: stored runs and trajectories rendered for the terminal with rich."""

from __future__ import annotations

import json

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from art_core.app.report import message_text
from art_core.app.runs import SUMMARY_KEYS, RunSummary
from art_core.rollouts.records import Trajectory

_ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}


def trajectory_panel(trajectory: Trajectory, label: str) -> Panel:
    """A panel with the trajectory's messages, metrics, metadata and logs (the judge's explanation)."""
    parts: list[RenderableType] = []
    for message in trajectory.messages:
        role = str(message.get("role", "?"))
        line = Text(f"{role}: ", style=f"bold {_ROLE_STYLE.get(role, 'white')}")
        line.append(message_text(message))
        parts.append(line)
    if trajectory.metrics:
        shown = ", ".join(f"{k}={float(v):.4g}" for k, v in sorted(trajectory.metrics.items()))
        parts.append(Text(f"metrics: {shown}", style="dim"))
    if trajectory.metadata:
        parts.append(Text(f"metadata: {json.dumps(trajectory.metadata, ensure_ascii=False)}", style="dim"))
    for log in trajectory.logs:
        parts.append(Text(f"log: {log}", style="italic"))
    title = f"{escape(label)}  reward {float(trajectory.reward or 0.0):.4g}"
    return Panel(Group(*parts), title=title, title_align="left")


def runs_table(runs: list[RunSummary]) -> Table:
    """A table of the runs: project, model, latest step, history steps and the latest metrics."""
    table = Table(title="runs")
    for column in ("project", "model", "step", "logged steps", *SUMMARY_KEYS):
        table.add_column(column, overflow="fold")
    for run in runs:
        metrics = [f"{run.latest[k]:.4g}" if k in run.latest else "-" for k in SUMMARY_KEYS]
        logged = (
            f"{len(run.history_steps)} ({run.history_steps[0]}-{run.history_steps[-1]})"
            if run.history_steps
            else "0"
        )
        table.add_row(escape(run.project), escape(run.model), str(run.latest_step), logged, *metrics)
    return table
