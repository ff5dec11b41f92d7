"""`hpctrain report RUN1 RUN2 ...`: several runs side by side, the best one named.

This module owns comparing runs: their final figures in one table (compare.md and compare.json), their
training loss and validation metrics over steps in one plot (compare.png), the best run and the criterion
that picked it, and each run's status. Reading a run is report.py's (`load_run`, which also reads a run
that is still going); a run that cannot be read yet (no metrics.jsonl, no complete step) is a row marked
missing, so one broken element of a sweep does not hide the others.

A run's status (finished, stopped, failed or running) is `runstatus.run_status`'s, the same as a one-run
report's.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ..base.durable import write_text
from ..base.errors import ConfigError, DataError, HpctrainError
from .figures import new_figure, note_empty, save_png
from .report import epochs, load_run
from .runstatus import run_status

COMPARE_FILES = {"plot": "compare.png", "table": "compare.md", "json": "compare.json"}
"""What a comparison writes into its out_dir, so the names are stable for scripts."""

CRITERIA = (("val_accuracy", "highest"), ("val_loss", "lowest"), ("train_loss", "lowest"))
"""The first figure that every readable run has picks the best run, in this order."""

# -- one run -------------------------------------------------------------------------------------------------

def read_row(name: str, run_dir: Path, now: float | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One run's final figures as a row of the comparison, and the run as `load_run` read it (None, and
    status "missing" with why, when it cannot be read yet).

    A finished run's figures are its summary's (train_loss: the last epoch's mean); a run without one gives
    its last logged step, the last logged window's loss, the last epoch's validation and the median
    throughput so far.
    """
    row: dict[str, Any] = {"name": name, "run_dir": str(run_dir), "status": "missing", "why": "",
                           "steps": None, "train_loss": None, "val_loss": None, "val_accuracy": None,
                           "samples_per_s": None, "train_time_s": None, "param_sha256": None}
    try:
        run = load_run(run_dir)
    except HpctrainError as exc:
        row["why"] = str(exc)
        return row, None
    row["status"], row["why"] = run_status(run, now)
    summary, metrics = run["summary"], run["metrics"]
    if summary is not None:
        row.update({k: summary.get(k) for k in ("steps", "train_loss", "val_loss", "val_accuracy", "samples_per_s",
                                                 "train_time_s", "param_sha256")})
        row.update({k: summary[k] for k in ("val_bits_per_byte", "tokens_per_s", "mfu") if k in summary})
        return row, run
    row.update(steps=metrics[-1]["step"], train_loss=metrics[-1].get("loss"))
    for key in ("val_loss", "val_accuracy"):
        row[key] = next((m[key] for m in reversed(epochs(metrics)) if key in m), None)
    speeds = [m["samples_per_s"] for m in metrics if isinstance(m.get("samples_per_s"), (int, float))]
    row["samples_per_s"] = statistics.median(speeds) if speeds else None
    return row, run


# -- several runs --------------------------------------------------------------------------------------------

def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name (a sweep names them KEY=V_KEY=V), or its path below the runs' common
    directory where two names are the same."""
    full = [Path(os.path.abspath(d)) for d in run_dirs]
    names = [p.name or str(p) for p in full]
    if len(set(names)) == len(names):
        return names
    common = Path(os.path.commonpath(full))
    return [p.relative_to(common).as_posix() or p.name for p in full]


def pick_best(rows: list[dict[str, Any]]) -> tuple[str | None, str | None, str]:
    """(best run's name, criterion, how it was picked) over the rows that are not missing.

    The criterion is the first of CRITERIA that every such run has; a run whose figure is not a finite
    number (a diverged run's NaN loss) can never be best.
    """
    present = [r for r in rows if r["status"] != "missing"]
    for key, direction in CRITERIA:
        if present and all(isinstance(r[key], (int, float)) for r in present):
            finite = [r for r in present if math.isfinite(r[key])]
            if not finite:
                return None, key, f"{direction} {key}: no run has a finite {key}"
            pick = max if direction == "highest" else min
            best = pick(finite, key=lambda r: r[key])  # the first of equals, in the order given
            scope = "every run has one" if len(present) == len(rows) else "every run that has metrics has one"
            return best["name"], key, f"{direction} {key} ({best[key]:.4f}; {scope})"
    return None, None, "no figure that every run has"


_DASHES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """Each run's colour, line style and marker, no two runs alike in all three (up to the palette's colours times
    the four line styles), and where along its line its markers sit: the runs' markers take turns, so that
    runs with the same figures (a rerun, a seed that does not matter) still show each one."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    turns = min(len(names), 4)
    return {name: {"color": palette(i % palette.N), "linestyle": _DASHES[(i + i // palette.N) % len(_DASHES)],
                   "marker": _MARKERS[i % len(_MARKERS)], "markevery": (i % turns, turns)}
            for i, name in enumerate(names)}


def _plot_panel(ax: Any, series: list[tuple[str, list[dict[str, Any]]]], key: str, best: str | None,
                styles: dict[str, dict[str, Any]]) -> None:
    drawn = 0
    for name, metrics in series:
        points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        if points:
            # the best run wide and underneath: a run drawn over it stays visible, even one with the same figures
            style = {"linewidth": 3.0 if name == best else 1.2, "zorder": 2 if name == best else 3}
            every = styles[name]["markevery"] if key == "loss" else None  # few points at epoch ends: mark all
            ax.plot(*zip(*points), markersize=4, label=name + (" (best)" if name == best else ""),
                    **{**styles[name], "markevery": every}, **style)
            drawn += 1
    if not drawn:
        note_empty(ax, f"no {key} logged yet")
        return
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def plot_comparison(series: list[tuple[str, list[dict[str, Any]]]], path: Path, best: str | None,
                    missing: tuple[str, ...] = ()) -> None:
    """Training loss (top) and validation loss and accuracy (below) over steps, one line per run; the
    best run drawn wider, underneath the others, and marked in the legend; each run its own colour, line style
    and marker (`_styles`); the `missing` runs named in the title."""
    styles = _styles([name for name, _ in series])
    fig = new_figure(11.0, max(7.0, 1.2 + 0.24 * len(series)))
    grid = fig.add_gridspec(2, 2)
    panels = {"loss": fig.add_subplot(grid[0, :]), "val_loss": fig.add_subplot(grid[1, 0]),
              "val_accuracy": fig.add_subplot(grid[1, 1])}
    titles = {"loss": "training loss (logged window)", "val_loss": "validation loss (epoch end)",
              "val_accuracy": "validation accuracy (epoch end)"}
    for key, ax in panels.items():
        _plot_panel(ax, series, key, best, styles)
        ax.set_title(titles[key], fontsize=10)
    handles, labels = [], []
    for ax in panels.values():  # one legend entry per run, from whichever panel drew it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8, title="run")
    title = f"{len(series)} runs compared"
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        title = f"{len(series)} of {len(series) + len(missing)} runs compared ({len(missing)} missing: {names})"
    fig.suptitle(title)
    save_png(fig, path)


_COLUMNS = {"steps": "{:,}", "train_loss": "{:.4f}", "val_loss": "{:.4f}", "val_accuracy": "{:.4f}",
            "samples_per_s": "{:,.0f}", "train_time_s": "{:,.1f}"}  # the table's figures and their formats


def render_table(result: dict[str, Any]) -> str:
    """The text of compare.md (pure: no I/O): the best run, the table of final figures, notes, the plot."""
    rows, best = result["runs"], result["best"]
    lines = [f"# Comparison of {len(rows)} runs", ""]
    lines += [f"**Best run: `{best}`**, by {result['criterion_text']}." if best else
              f"**No best run**: {result['criterion_text']}.", ""]
    lines += ["| run | status | steps | train loss | val_loss | val_accuracy | samples/s | wall s | param_sha256 |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = f"`{r['name']}`".replace("|", "\\|") + (" **(best)**" if r["name"] == best else "")
        sha = f"`{r['param_sha256'][:12]}`" if r["param_sha256"] else ""
        figures = [form.format(r[k]) if isinstance(r[k], (int, float)) else "" for k, form in _COLUMNS.items()]
        cells = [name, r["status"], *figures, sha]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    notes = [r for r in rows if r["status"] != "finished"]
    if notes:
        lines += ["Runs not finished" + (" (their figures so far: train loss of the last logged window, "
                                         "validation of the last epoch, median samples/s)" if
                                         any(r["status"] != "missing" for r in notes) else "") + ":", ""]
        lines += [f"- `{r['name']}` {r['status']}: {r['why']}" for r in notes]
        lines.append("")
    lines += ["## Loss and validation over steps", "", f"![Loss and validation over steps]({COMPARE_FILES['plot']})",
              "", "## Run directories", ""]
    lines += [f"- `{r['name']}`: `{r['run_dir']}`" for r in rows]
    return "\n".join(lines) + "\n"


def compare_runs(run_dirs: list[Path], out_dir: Path) -> dict[str, Any]:
    """Compare several runs (finished or not) into out_dir: compare.png, compare.md and compare.json.

    Returns {"best": the best run's name or None, "criterion": the figure that picked it ("val_accuracy",
    "val_loss" or "train_loss"), "criterion_text": how, "runs": one row per run in the order given (see
    `read_row`), "files": {"plot", "table", "json"}: the paths written}. A run that cannot be read is a row
    with status "missing"; when none can be read, DataError, and nothing is written.
    """
    run_dirs, out_dir = [Path(d) for d in run_dirs], Path(out_dir)
    if not run_dirs:
        raise ConfigError("no run directory to compare: pass one or more --run-dir of `hpctrain train` runs")
    seen = [os.path.realpath(d) for d in run_dirs]
    twice = sorted({str(d) for d, real in zip(run_dirs, seen) if seen.count(real) > 1})
    if twice:
        raise ConfigError(f"run directory {twice[0]!r} is passed twice: pass each run once")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {str(out_dir)!r} is a file: pass a directory for the comparison")
    now = time.time()
    read = [read_row(name, d, now) for name, d in zip(run_names(run_dirs), run_dirs)]
    rows = [row for row, _ in read]
    if all(r["status"] == "missing" for r in rows):
        why = "; ".join(f"{r['name']}: {r['why']}" for r in rows[:3]) + ("; ..." if len(rows) > 3 else "")
        raise DataError(f"none of the {len(rows)} run directories has a logged step to compare ({why}); pass "
                        "the --run-dir of `hpctrain train` runs that have logged at least one step")
    best, criterion, text = pick_best(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {key: out_dir / name for key, name in COMPARE_FILES.items()}
    series = [(row["name"], run["metrics"]) for row, run in read if run is not None]
    plot_comparison(series, files["plot"], best, tuple(r["name"] for r in rows if r["status"] == "missing"))
    result = {"best": best, "criterion": criterion, "criterion_text": text, "runs": rows, "files": files}
    write_text(files["table"], render_table(result))
    plain = {**result, "files": {k: str(p) for k, p in files.items()}}
    write_text(files["json"], json.dumps(_strict(plain), indent=2, allow_nan=False) + "\n")
    return result


def _strict(value: Any) -> Any:
    """`value` with NaN and infinities (a diverged run's loss) as null: compare.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value
