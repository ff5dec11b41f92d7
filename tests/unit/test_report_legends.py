"""The report's and the comparison's plots keep their legends off the data, and two identical runs stay
visible in compare.png (#54 item 10: legends were drawn over the data, and a run was hidden under an identical
one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import hpctrain
from hpctrain.tools import compare, figures, report, tracereport


@pytest.fixture(scope="module")
def traced(digits2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run of 2 epochs, steps 2-9 traced (every plot of a report has something to draw)."""
    run = tmp_path_factory.mktemp("legends") / "run"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "2", "--batch-size", "64",
              "--log-every", "3", "--trace", "2:9", "--checkpoint-every", "0"], timeout=240)
    return run


def _figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every figure the report modules save, kept for a look at its layout."""
    kept = []

    def keep(fig: object, path: Path) -> None:
        kept.append(fig)
        figures.save_png(fig, path)

    for module in (report, tracereport, compare):
        monkeypatch.setattr(module, "save_png", keep)
    return kept


def _overlaps(fig: object) -> list[str]:
    """Each legend of `fig` that lies over an axes' data area."""
    fig.canvas.draw()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    out = []
    for legend in legends:
        box = legend.get_window_extent()
        for ax in fig.axes:
            if ax.has_data() and box.overlaps(ax.bbox):
                out.append(f"{fig.get_suptitle() or ax.get_title()}: legend over {ax.get_title() or ax.get_ylabel()}")
    return out


def test_no_legend_is_drawn_over_data(traced: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _figures(monkeypatch)
    report.report(traced, tmp_path / "report")
    other = tmp_path / "other"
    shutil.copytree(traced, other)
    compare.compare_runs([traced, other], tmp_path / "compare")
    assert len(kept) == 6  # loss, accuracy, throughput, timing, straggler; compare
    assert sum(bool(f.legends) or any(ax.get_legend() for ax in f.axes) for f in kept) == 6
    assert [o for f in kept for o in _overlaps(f)] == []


def _pixels_near(image: np.ndarray, rgb: tuple[float, float, float]) -> int:
    return int((np.abs(image[..., :3] - np.array(rgb)).max(axis=-1) < 0.06).sum())


def test_identical_runs_are_both_visible_in_compare_png(traced: Path, tmp_path: Path) -> None:
    import matplotlib.colors
    import matplotlib.image

    twin = tmp_path / "twin"
    shutil.copytree(traced, twin)
    compare.compare_runs([traced, twin], tmp_path / "out")
    image = matplotlib.image.imread(tmp_path / "out" / "compare.png")
    plot = image[:, : int(image.shape[1] * 0.7)]  # left of the legend, which shows every colour anyway
    first, second = (_pixels_near(plot, matplotlib.colors.to_rgb(f"C{i}")) for i in (0, 1))
    assert min(first, second) > 0.2 * max(first, second), (first, second)
