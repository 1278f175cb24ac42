"""`art report`: one self-contained HTML page about a run (curves + best and worst trajectories).

The page needs no server and no network: charts are inline SVG (`art_core.app.svg`), styles are
inline, there is no JavaScript. Every piece of user text (messages, names, logs, metadata) goes
through `html.escape`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from art_core.app.runs import best_and_worst, merged_history, step_groups, trajectory_steps
from art_core.app.svg import polyline_chart
from art_core.rollouts.records import Trajectory
from art_core.storage import ModelStorage, atomic_write_bytes

CURVES: tuple[tuple[str, str], ...] = (
    ("train/reward", "reward (train)"),
    ("val/reward", "reward (val)"),
    ("loss/train", "loss"),
    ("loss/entropy", "entropy"),
    ("loss/kl_policy_ref", "KL to the base model"),
    ("loss/grad_norm", "grad norm"),
    ("time/step_s", "time per train step (s)"),
)
"""(history key, chart title) of each curve in the report."""

_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #111; max-width: 72em; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.trajectory { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em 1em; margin: 0.8em 0; }
.trajectory h4 { margin: 0.2em 0 0.5em; }
.message { margin: 0.3em 0; white-space: pre-wrap; }
.role { font-weight: bold; }
.logs, .meta { color: #444; font-size: 0.9em; white-space: pre-wrap; }
"""


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content (parts joined) and any tool calls as `name(arguments)`."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(
            str(part.get("text", part)) if isinstance(part, dict) else str(part) for part in content
        )
    parts = [str(content)] if content else []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        parts.append(f"-> {function.get('name', '?')}({function.get('arguments', '')})")
    return "\n".join(parts)


def _trajectory_html(trajectory: Trajectory, label: str) -> str:
    e = html.escape
    messages = "".join(
        f'<div class="message"><span class="role">{e(str(m.get("role", "?")))}:</span> {e(message_text(m))}</div>'
        for m in trajectory.messages
    )
    metrics = ", ".join(f"{e(str(k))}={float(v):.4g}" for k, v in sorted(trajectory.metrics.items()))
    meta = e(json.dumps(trajectory.metadata, ensure_ascii=False)) if trajectory.metadata else ""
    logs = "".join(f"<div>{e(line)}</div>" for line in trajectory.logs)
    return (
        f'<div class="trajectory"><h4>{e(label)}: reward {float(trajectory.reward or 0.0):.4g}</h4>'
        f"{messages}"
        + (f'<div class="meta">metrics: {metrics}</div>' if metrics else "")
        + (f'<div class="meta">metadata: {meta}</div>' if meta else "")
        + (f'<div class="logs"><b>logs (judge explanations)</b>{logs}</div>' if logs else "")
        + "</div>"
    )


def _step_html(storage: ModelStorage, split: str, step: int, count: int) -> str:
    groups = step_groups(storage, split, step)
    best, worst = best_and_worst(groups, count)
    body = "".join(_trajectory_html(t, f"best #{i + 1}") for i, t in enumerate(best))
    body += "".join(_trajectory_html(t, f"worst #{i + 1}") for i, t in enumerate(worst))
    if not best:
        body = "<p>no rewarded trajectory at this step</p>"
    return f"<h3>{html.escape(split)} step {step}</h3>{body}"


def default_steps(storage: ModelStorage, split: str) -> list[int]:
    """The first and the last step with stored trajectories (one step if they are the same)."""
    steps = trajectory_steps(storage, split)
    return sorted({steps[0], steps[-1]}) if steps else []


def render_report(
    storage: ModelStorage,
    title: str,
    steps: Sequence[int] | None = None,
    split: str = "train",
    count: int = 2,
) -> str:
    """The report's HTML: a chart per `CURVES` entry, then `count` best and worst trajectories of each step."""
    rows = merged_history(storage.read_history())
    charts = "".join(
        polyline_chart(
            [(float(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)], name
        )
        for key, name in CURVES
    )
    chosen = default_steps(storage, split) if steps is None else list(steps)
    sections = "".join(_step_html(storage, split, step, count) for step in chosen)
    e = html.escape
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{e(title)}</h1>"
        f"<p>{len(rows)} steps in history; trajectories of {e(split)} steps {e(', '.join(map(str, chosen)) or 'none')}.</p>"
        f'<h2>Curves</h2><div class="charts">{charts}</div>'
        f"<h2>Trajectories</h2>{sections or '<p>no stored trajectories</p>'}</body></html>\n"
    )


def write_report(
    storage: ModelStorage,
    title: str,
    out: Path,
    steps: Sequence[int] | None = None,
    split: str = "train",
    count: int = 2,
) -> Path:
    """Write `render_report(...)` to `out` atomically and return `out`."""
    atomic_write_bytes(Path(out), render_report(storage, title, steps, split, count).encode("utf-8"))
    return Path(out)
