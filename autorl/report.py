"""The end of a run: a reward-curve PNG and a short Markdown report.

The report leads with the head-to-head win rate (trained vs step 0 on the validation inputs,
with its interval), then the mean RULER score per step, what went wrong (judge and rollout
errors, steps that trained nothing) and a few validation answers side by side. RULER scores are
relative within a group, so the per-step mean is a health signal, not a measure of progress;
the win rate is. Uses matplotlib's object API only (no pyplot state).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from art_core.atomic import atomic_write_bytes

RULER_LABEL = "mean RULER score"
"""What autorl's per-step reward is (callers that score otherwise, such as mcp_rl, pass their own)."""
RULER_NOTE = "relative within each group: a health signal, not the score"


def plot_rewards(
    history: Sequence[Mapping[str, Any]], path: Path, *, title: str, ylabel: str = RULER_LABEL
) -> Path | None:
    """Mean reward per step (band: min..max) as a PNG at `path`; None when no step has a reward."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in history if isinstance(r.get("reward"), int | float) and math.isfinite(r["reward"])]
    if not rows:
        return None
    xs = [r["step"] for r in rows]
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if all(r.get("reward_min") is not None and r.get("reward_max") is not None for r in rows):
        axes.fill_between(
            xs, [r["reward_min"] for r in rows], [r["reward_max"] for r in rows], alpha=0.2, linewidth=0
        )
    axes.plot(xs, [r["reward"] for r in rows], marker="o" if len(xs) < 30 else None, linewidth=1.5)
    axes.set(title=title, xlabel="step", ylabel=ylabel, ylim=(-0.05, 1.05))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())
    return path


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "-" if value is None else str(value)


def _cell(text: str, limit: int = 160) -> str:
    one_line = " ".join(text.split())
    return (one_line[:limit] + ("…" if len(one_line) > limit else "")).replace("|", "\\|")


def headline(summary: Mapping[str, Any]) -> str:
    """One sentence on the win rate; pure. `summary["judged"]` False: the run had no judge at all."""
    rate, ci = summary.get("win_rate"), summary.get("win_rate_ci") or (0.0, 1.0)
    if rate is None:
        if summary.get("judged") is False:
            return "The run had no judge (`--judge none`), so there is no head-to-head win rate."
        return "No validation input could be judged, so there is no win rate (see the judge errors below)."
    verdict = "better than" if ci[0] > 0.5 else "worse than" if ci[1] < 0.5 else "not distinguishable from"
    return (
        f"The trained model wins **{rate:.0%}** of head-to-head comparisons against the step-0 model "
        f"(95% CI {ci[0]:.0%}–{ci[1]:.0%}, {summary.get('inputs_val')} validation inputs): {verdict} where it started."
    )


def render_report(
    summary: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    *,
    notes: Sequence[str] = (),
    examples: Sequence[Mapping[str, str]] = (),
    plot: str | None = None,
    reward_label: str = RULER_LABEL,
    reward_note: str = RULER_NOTE,
) -> str:
    """The Markdown report; pure. `examples`: dicts with `input`, `trained`, `baseline`;
    `reward_label` and `reward_note` say what the per-step reward is."""
    lines = [
        f"# AutoRL: {summary.get('task')}",
        "",
        headline(summary),
        "",
        f"- steps trained: {summary.get('steps')} in {_fmt(summary.get('seconds'), 0)} s",
        f"- inputs: {summary.get('inputs_train')} train, {summary.get('inputs_val')} validation",
        f"- {reward_label}: first steps {_fmt(summary.get('first_reward'))}, last steps "
        f"{_fmt(summary.get('last_reward'))} ({reward_note})",
        f"- judge errors: {summary.get('judge_errors')} (counted, never scored)",
    ]
    lines += [f"- {note}" for note in notes]
    if plot:
        lines += ["", f"![{reward_label} per step]({plot})"]
    lines += [
        "",
        "## Per step",
        "",
        f"| step | {reward_label} | groups scored | judge errors | rollout errors | trained |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in history:
        lines.append(
            f"| {r.get('step')} | {_fmt(r.get('reward'))} | {r.get('groups_scored')}/{r.get('groups')} | "
            f"{r.get('judge_errors')} | {r.get('rollout_errors')} | {'yes' if r.get('trained') else 'no'} |"
        )
    if examples:
        lines += ["", "## Validation answers", "", "| input | trained | step 0 |", "|---|---|---|"]
        for e in examples:
            lines.append(f"| {_cell(e['input'])} | {_cell(e['trained'])} | {_cell(e['baseline'])} |")
    return "\n".join(lines) + "\n"


def write_report(
    out: Path,
    summary: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    *,
    notes: Sequence[str] = (),
    examples: Sequence[Mapping[str, str]] = (),
    reward_label: str = RULER_LABEL,
    reward_note: str = RULER_NOTE,
) -> tuple[Path, Path | None]:
    """Write `reward.png` and `report.md` into `out`; returns their paths (the PNG's None if nothing to plot)."""
    title = f"AutoRL: {str(summary.get('task'))[:60]}"
    png = plot_rewards(history, out / "reward.png", title=title, ylabel=reward_label)
    text = render_report(
        summary,
        history,
        notes=notes,
        examples=examples,
        plot=png.name if png else None,
        reward_label=reward_label,
        reward_note=reward_note,
    )
    report = out / "report.md"
    atomic_write_bytes(report, text.encode("utf-8"))
    return report, png


__all__ = ["headline", "plot_rewards", "render_report", "write_report"]
