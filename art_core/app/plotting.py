"""The reward curve PNG written at the end of a run.

Uses matplotlib's object API (`Figure` + the Agg canvas) so that importing this module, or
`art_core`, never touches matplotlib's global backend or pyplot state.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from art_core.atomic import atomic_write_bytes


def _series(history: list[dict[str, float]], key: str) -> list[tuple[float, dict[str, float]]]:
    """(x, row) for every row that has a finite `key`; x is the row's `step`, else its index."""
    points = []
    for index, row in enumerate(history):
        value = row.get(key)
        if value is not None and math.isfinite(value):
            points.append((float(row.get("step", index)), row))
    return points


def _band(points: list[tuple[float, dict[str, float]]], key: str) -> tuple[list[float], list[float]] | None:
    """Lower and upper edges from `<key>_min`/`<key>_max`, else mean ± `<key>_std`, else None."""
    rows = [row for _, row in points]
    if all(f"{key}_min" in r and f"{key}_max" in r for r in rows):
        return [r[f"{key}_min"] for r in rows], [r[f"{key}_max"] for r in rows]
    if all(f"{key}_std" in r for r in rows):
        return [r[key] - r[f"{key}_std"] for r in rows], [r[key] + r[f"{key}_std"] for r in rows]
    return None


def plot_reward_curve(
    history: list[dict[str, float]],
    path: Path,
    *,
    title: str = "reward",
    key: str = "train/reward",
) -> Path:
    """Draw the mean of `key` per step to a PNG at `path` (written atomically) and return `path`.

    A light band shows `<key>_min`..`<key>_max` when every row has them, else ± `<key>_std`.

    Raises:
        ValueError: no row of `history` has a finite value for `key`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = _series(history, key)
    if not points:
        raise ValueError(f"no history row has a finite {key!r}; nothing to plot (got {len(history)} rows)")
    xs = [x for x, _ in points]
    ys = [row[key] for _, row in points]
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    band = _band(points, key)
    if band is not None:
        axes.fill_between(xs, band[0], band[1], alpha=0.2, linewidth=0)
    axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, linewidth=1.5)
    axes.set(title=title, xlabel="step", ylabel=key)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    png = io.BytesIO()
    figure.savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())
    return path
