"""Figures for the reports (`report`, `compare`, `tracereport`): drawn through matplotlib's Agg canvas directly (no
pyplot, no global backend switch), so a report can be made on a login node with no display, from a process that
already uses another backend; each PNG is written whole or not at all."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..base.durable import replacing


def new_figure(width: float = 7.0, height: float = 4.0) -> Any:
    """A figure drawn through its own Agg canvas (no pyplot, no global backend): safe on a login node."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def note_empty(ax: Any, note: str) -> None:
    """An axes that says why it has no data instead of drawing an empty frame."""
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def save_png(fig: Any, path: Path) -> None:
    """Write the figure as a PNG whole or not at all."""
    with replacing(path) as tmp:  # someone may be viewing the report while it is regenerated
        fig.savefig(tmp, format="png")


def by_rank(ax: Any, series: dict[int, tuple[list[float], list[float]]], title: str, ylabel: str | None,
            color: str | None = None, few: int = 8) -> None:
    """One quantity over the steps, {rank: (steps, values)}: a line per rank up to `few` ranks, beyond that the
    median rank and the min-max band of all; titled, on a grid from zero (the y label on the first column). Each
    line is labelled for the figure's one legend (`legend_outside`), drawn outside the axes."""
    if len(series) <= few:
        for r, (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, linewidth=1, label=f"rank {r}", color=f"C{r % 10}" if color is None else None)
    else:
        at: dict[float, list[float]] = {}
        for xs, ys in series.values():
            for x, y in zip(xs, ys):
                at.setdefault(x, []).append(y)
        steps = sorted(at)
        ax.fill_between(steps, [min(at[t]) for t in steps], [max(at[t]) for t in steps], color=color, alpha=0.3,
                        linewidth=0, label=f"min-max of {len(series)} ranks")
        ax.plot(steps, [statistics.median(at[t]) for t in steps], color=color, linewidth=1, label="median rank")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ylabel is not None:
        ax.set_ylabel(ylabel)


def legend_outside(fig: Any, axes: list[Any], loc: str = "outside lower center", ncols: int = 1) -> None:
    """One legend of what `axes` drew (each label once), outside every axes so that it never covers data: the
    figure's constrained layout makes room for it at `loc` ("outside lower center", "outside right upper")."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc=loc, ncols=ncols, fontsize=8)
