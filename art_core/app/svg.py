"""A line chart as inline SVG: pure string building, no JavaScript, no fonts or files to fetch."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

_PAD_LEFT, _PAD_RIGHT, _PAD_TOP, _PAD_BOTTOM = 52.0, 12.0, 24.0, 28.0


def _label(value: float) -> str:
    return f"{value:.3g}"


def _scale(lo: float, hi: float) -> tuple[float, float]:
    """A non-empty range around [lo, hi] (a flat series gets a band around its value)."""
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.1 or 1.0
    return lo - pad, hi + pad


def _x_labels(xs: Sequence[float], y: float, right: float) -> list[tuple[float, float, str, str]]:
    """The step labels under the x axis: first and last, or the one step of a one-step series (centred)."""
    if min(xs) == max(xs):
        return [((_PAD_LEFT + right) / 2, y, "middle", f"step {_label(xs[0])}")]
    return [(_PAD_LEFT, y, "start", f"step {_label(min(xs))}"), (right, y, "end", f"step {_label(max(xs))}")]


def polyline_chart(
    points: Sequence[tuple[float, float]],
    title: str,
    *,
    width: int = 360,
    height: int = 180,
    color: str = "#2563eb",
) -> str:
    """An `<svg>` with one `<polyline>` through the finite `points` (x ascending), axes and labels.

    Non-finite points are left out; a chart without any finite point says "no data" instead of a
    line. `title` is escaped, so it may hold any text.
    """
    finite = sorted((float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y))
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">'
        f'<text x="{_PAD_LEFT}" y="16" font-size="13" font-family="sans-serif">{html.escape(title)}</text>'
    )
    if not finite:
        return (
            head
            + f'<text x="{width / 2}" y="{height / 2}" font-size="12" text-anchor="middle">no data</text></svg>'
        )
    xs, ys = [x for x, _ in finite], [y for _, y in finite]
    x_lo, x_hi = _scale(min(xs), max(xs))
    y_lo, y_hi = _scale(min(ys), max(ys))
    plot_w, plot_h = width - _PAD_LEFT - _PAD_RIGHT, height - _PAD_TOP - _PAD_BOTTOM

    def at(x: float, y: float) -> str:
        px = _PAD_LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w
        py = _PAD_TOP + (1.0 - (y - y_lo) / (y_hi - y_lo)) * plot_h
        return f"{px:.1f},{py:.1f}"

    bottom, right = _PAD_TOP + plot_h, _PAD_LEFT + plot_w
    axes = (
        f'<polyline class="axis" points="{_PAD_LEFT},{_PAD_TOP} {_PAD_LEFT},{bottom} {right},{bottom}" '
        'fill="none" stroke="#888" stroke-width="1"/>'
    )
    labels = "".join(
        f'<text x="{x}" y="{y}" font-size="10" font-family="sans-serif" text-anchor="{anchor}">{text}</text>'
        for x, y, anchor, text in (
            (_PAD_LEFT - 4, _PAD_TOP + 8, "end", _label(y_hi)),
            (_PAD_LEFT - 4, bottom, "end", _label(y_lo)),
            *_x_labels(xs, bottom + 14, right),
            (right, 16, "end", f"last {_label(ys[-1])}"),
        )
    )
    line = " ".join(at(x, y) for x, y in finite)
    dots = (
        "".join(
            f'<circle cx="{at(x, y).split(",")[0]}" cy="{at(x, y).split(",")[1]}" r="2" fill="{color}"/>'
            for x, y in finite
        )
        if len(finite) <= 60
        else ""
    )
    data = f'<polyline class="series" points="{line}" fill="none" stroke="{color}" stroke-width="2"/>'
    return head + axes + labels + data + dots + "</svg>"
