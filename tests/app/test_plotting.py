"""plot_reward_curve writes a real PNG, atomically, without touching pyplot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from art_core.app.plotting import plot_reward_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(extra: bool) -> list[dict[str, float]]:
    rows = []
    for step in range(5):
        row = {"step": float(step), "train/reward": 0.1 * step}
        if extra:
            row |= {"train/reward_std": 0.05, "train/reward_min": 0.0, "train/reward_max": 0.1 * step + 0.2}
        rows.append(row)
    return rows


@pytest.mark.parametrize("extra", [False, True])
def test_writes_a_png(tmp_path: Path, extra: bool) -> None:
    path = plot_reward_curve(history(extra), tmp_path / "plots" / "reward.png", title="demo")
    assert path == tmp_path / "plots" / "reward.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert [p.name for p in path.parent.iterdir()] == ["reward.png"], "no temporary file is left behind"


def test_std_band_only_and_rows_without_the_key(tmp_path: Path) -> None:
    rows = [
        {"train/reward": 1.0, "train/reward_std": 0.5},
        {"train/loss": 2.0},
        {"train/reward": 2.0, "train/reward_std": 0.1},
    ]
    path = plot_reward_curve(rows, tmp_path / "r.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_overwrites_atomically(tmp_path: Path) -> None:
    path = tmp_path / "reward.png"
    path.write_bytes(b"old")
    plot_reward_curve(history(False), path)
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("rows", [[], [{"train/loss": 1.0}], [{"train/reward": float("nan")}]])
def test_nothing_to_plot_is_a_value_error(tmp_path: Path, rows: list[dict[str, float]]) -> None:
    with pytest.raises(ValueError, match="train/reward"):
        plot_reward_curve(rows, tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


def test_does_not_import_pyplot(tmp_path: Path) -> None:
    had_pyplot = "matplotlib.pyplot" in sys.modules
    plot_reward_curve(history(False), tmp_path / "r.png")
    assert had_pyplot or "matplotlib.pyplot" not in sys.modules
