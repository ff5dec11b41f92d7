"""`hpctrain report`: turn a run directory into PNG plots and a short markdown summary.

This module owns reading what `train` leaves in RUN (metrics.jsonl, logs/rank-NNNN.jsonl, summary.json,
config.toml) and drawing it. It reads a run that is still going: the trainer appends to the jsonl files, so
an unterminated last line is a line being written and is skipped. A run without summary.json is "in
progress" unless it says it stopped or failed (`runstatus`: a logged stop or error, or processes that are
gone). Epochs are counted from 1, as the console counts them
(metrics.jsonl numbers them from 0). Nothing here imports torch or MPI; matplotlib is imported inside the drawing functions only,
and it draws through the Agg canvas directly (no pyplot, no global backend switch), so a report can be made
on a login node with no display, from a process that already uses another backend.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from ..base.config import read_train_toml
from ..base.durable import write_text
from ..base.errors import ConfigError, DataError
from .figures import by_rank, legend_outside, new_figure, note_empty, save_png
from .runstatus import run_status

PLOTS = {
    "loss": "loss.png",
    "accuracy": "accuracy.png",
    "throughput": "throughput.png",
    "timing": "timing.png",
}
"""The PNGs every report writes (a plot with no data yet says so), so their names are stable for scripts."""

_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "data": "#55A868"}
_TABLE_ROWS = 10  # epochs / ranks listed in report.md before the tables are cut to the last / slowest ones


# -- reading a run -------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a jsonl file that a writer may still be appending to.

    An unterminated last line that does not parse is a line being written and is skipped; any other line
    that is not a JSON object is corruption and raises DataError naming the file and line.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it yet: the writer is mid-line
                continue
            raise DataError(f"{path}:{number} is not valid JSON ({exc.msg}); the file is damaged: remove that "
                            "line or re-run the training") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{number} is not a JSON object; the file is damaged: remove that line or "
                            "re-run the training")
        records.append(obj)
    return records


def by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a numeric step, sorted by step, keeping the last one written for a repeated step."""
    latest = {}
    for rec in records:
        if isinstance(rec.get("step"), (int, float)):
            latest[rec["step"]] = rec
    return [latest[s] for s in sorted(latest)]


def load_run(run_dir: Path) -> dict[str, Any]:
    """Everything a report needs from RUN: metrics, per-rank timing, summary (None while in progress), config.

    Raises ConfigError when RUN is not a directory and DataError when it has no logged step yet.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist: pass the --run-dir of a "
                          "`hpctrain train` run")
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} is not a directory: pass the --run-dir of a "
                          "`hpctrain train` run")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise DataError(f"no {metrics_path} yet: is {str(run_dir)!r} a `hpctrain train` run dir? If it is "
                        "starting, wait until it logs its first step (--log-every), then run report again")
    metrics = by_step(read_jsonl(metrics_path))
    if not metrics:
        raise DataError(f"{metrics_path} has no complete step yet: wait until the run logs its first step "
                        "(--log-every), then run report again")
    ranks: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "logs").glob("rank-*.jsonl")):
        try:
            rank = int(path.stem.split("-", 1)[1])
        except ValueError:
            continue
        records = by_step(read_jsonl(path))
        if records:
            ranks[rank] = records
    summary, stale = None, None
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{summary_path} is not valid JSON ({exc.msg}); the file is damaged: delete it "
                            "and the report shows the run as in progress") from None
        if not isinstance(summary, dict):
            raise DataError(f"{summary_path} is not a JSON object; the file is damaged: delete it and the report "
                            "shows the run as in progress")
        # A run ends by logging its last step and then writing the summary, so a summary whose step count is
        # not the last logged step belongs to an earlier run in this directory (resumed or restarted since).
        if summary.get("steps") != metrics[-1]["step"]:
            summary, stale = None, summary.get("steps", "?")
        elif isinstance(summary.get("world_size"), int):  # drop rank logs left by an earlier run on more ranks
            ranks = {r: recs for r, recs in ranks.items() if r < summary["world_size"]}
    return {"run_dir": run_dir, "metrics": metrics, "ranks": ranks, "summary": summary, "stale_summary": stale,
            "config": _read_config(run_dir / "config.toml")}


def epoch_number(rec: dict[str, Any]) -> Any:
    """A record's epoch as the console counts it, from 1 (metrics.jsonl counts from 0); '?' without one."""
    epoch = rec.get("epoch")
    return epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else "?"


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        return read_train_toml(path.read_text())  # flat keys; a run written before a rename or the sections reads the same
    except (OSError, ValueError):  # TOMLDecodeError is a ValueError
        return None  # the config is context for the reader, not needed for the numbers


# -- numbers -------------------------------------------------------------------------------------------------

def epochs(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The end-of-epoch records (the ones that carry validation or the epoch's train loss)."""
    return [m for m in metrics if "val_accuracy" in m or "val_loss" in m or "epoch_train_loss" in m]


def step_parts(rec: dict[str, Any]) -> dict[str, float]:
    """Compute, comm and data ms per step of one per-rank timing record (compute = step - comm if absent)."""
    comm = float(rec.get("comm_ms", 0.0))
    compute = float(rec.get("compute_ms", float(rec.get("step_ms", 0.0)) - comm))
    return {"compute": compute, "comm": comm, "data": float(rec.get("data_ms", 0.0))}


def rank_means(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean compute, comm and data ms per step of one rank, each logged window weighted by its steps."""
    total = {"compute": 0.0, "comm": 0.0, "data": 0.0}
    steps, previous = 0.0, 0
    for rec in records:
        n = max(1, rec["step"] - previous)
        previous = rec["step"]
        for part, ms in step_parts(rec).items():
            total[part] += n * ms
        steps += n
    return {k: v / steps for k, v in total.items()} if steps else total


# -- plots ---------------------------------------------------------------------------------------------------

def _epoch_lines(ax: Any, metrics: list[dict[str, Any]]) -> None:
    ends = [m["step"] for m in epochs(metrics)]
    if 0 < len(ends) <= 30:  # more would hide the data
        for step in ends:
            ax.axvline(step, color="0.85", linewidth=0.8, zorder=0)


def plot_loss(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss per logged step, and validation loss at the end of each epoch."""
    fig = new_figure()
    ax = fig.add_subplot()
    train = [m for m in metrics if "loss" in m]
    val = [m for m in metrics if "val_loss" in m]
    if not train and not val:
        note_empty(ax, "no loss logged yet")
    else:
        _epoch_lines(ax, metrics)
        ax.plot([m["step"] for m in train], [m["loss"] for m in train], label="train loss (logged window)",
                color="#4C72B0", linewidth=1.2)
        if val:
            ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o-", label="validation loss (epoch end)",
                    color="#C44E52", markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        legend_outside(fig, [ax], ncols=2)
    ax.set_title(f"Loss: {title}")
    save_png(fig, path)


def plot_accuracy(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    """Validation accuracy per epoch, the best epoch marked."""
    fig = new_figure()
    ax = fig.add_subplot()
    val = [m for m in epochs(metrics) if "val_accuracy" in m]
    if not val:
        note_empty(ax, "no validation yet (first epoch not finished, or no val split)")
    else:
        xs = [m["epoch"] + 1 if isinstance(m.get("epoch"), int) else i + 1 for i, m in enumerate(val)]  # as the console
        ys = [m["val_accuracy"] for m in val]
        ax.plot(xs, ys, "o-", color="#55A868", markersize=4, label="val_accuracy")
        best = max(range(len(ys)), key=ys.__getitem__)
        ax.plot([xs[best]], [ys[best]], "*", color="#C44E52", markersize=12,
                label=f"best {ys[best]:.4f} (epoch {xs[best]})")
        legend_outside(fig, [ax], ncols=2)
        ax.set_ylim(max(0.0, min(ys) - 0.05), min(1.0, max(ys) + 0.02) + 0.01)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
    ax.set_title(f"Validation accuracy: {title}")
    save_png(fig, path)


def plot_throughput(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training samples per second (all ranks) per logged window, with its median (tokens per second and MFU
    for a language model)."""
    fig = new_figure()
    ax = fig.add_subplot()
    unit = "tokens/s" if any("tokens_per_s" in m for m in metrics) else "samples/s"
    key = unit.replace("/", "_per_")
    rows = [m for m in metrics if key in m]
    if not rows:
        note_empty(ax, "no throughput logged yet")
    else:
        _epoch_lines(ax, metrics)
        ys = [m[key] for m in rows]
        ax.plot([m["step"] for m in rows], ys, color="#8172B3", linewidth=1.2, label=f"{unit} (logged window)")
        median = statistics.median(ys)
        mfu = [m["mfu"] for m in rows if "mfu" in m]
        ax.axhline(median, color="0.3", linestyle="--", linewidth=1, label=f"median {median:,.0f} {unit}"
                   + (f", MFU {statistics.median(mfu):.2f}" if mfu else ""))
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter("{x:,.0f}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{unit} (all ranks)")
        ax.grid(alpha=0.3)
        legend_outside(fig, [ax], ncols=2)
    ax.set_title(f"Throughput: {title}")
    save_png(fig, path)


def plot_timing(ranks: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Per rank: mean compute, communication and data ms per step (stacked bars), and each over the steps."""
    fig = new_figure(10.0, 6.5)
    if not ranks:
        note_empty(fig.add_subplot(), "no per-rank timing yet (RUN/logs/rank-*.jsonl)")
        fig.suptitle(f"Time per step by rank: {title}")
        save_png(fig, path)
        return
    grid = fig.add_gridspec(2, 3, height_ratios=[1.2, 1])
    bars = fig.add_subplot(grid[0, :])
    order = sorted(ranks)
    means = {r: rank_means(ranks[r]) for r in order}
    bottom = [0.0] * len(order)
    labels = {"compute": "compute", "comm": "communication", "data": "data loading"}
    for part in ("compute", "comm", "data"):
        heights = [means[r][part] for r in order]
        bars.bar(order, heights, bottom=bottom, color=_COLORS[part], label=labels[part], width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    bars.set_xlabel("rank")
    bars.set_ylabel("mean ms per step")
    bars.set_xticks(order if len(order) <= 32 else order[:: max(1, len(order) // 16)])
    bars.grid(axis="y", alpha=0.3)
    bars.set_ylim(0, max(bottom) * 1.1 or 1.0)
    for col, part in enumerate(("compute", "comm", "data")):  # a line per rank, or the median and the band
        series = {r: ([x["step"] for x in ranks[r]], [step_parts(x)[part] for x in ranks[r]]) for r in order}
        by_rank(fig.add_subplot(grid[1, col]), series, labels[part], "ms per step" if col == 0 else None,
                color=_COLORS[part] if len(order) > 8 else None)
    legend_outside(fig, fig.axes[:2], "outside right upper")  # the bars' parts, then the ranks' lines
    fig.suptitle(f"Time per step by rank: {title}")
    save_png(fig, path)


# -- markdown ------------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "**no**", None: "none"}[value]
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4f}"
    return f"`{value}`"


def render_markdown(run: dict[str, Any], out_dir: Path) -> str:
    """The text of report.md (pure: no I/O); links point at the PNGs beside it in out_dir."""
    metrics, summary, config = run["metrics"], run["summary"], run["config"]
    last = metrics[-1]
    lines = [f"# Run report: `{run['run_dir']}`", ""]
    if summary is None:
        val = [m for m in metrics if "val_accuracy" in m]
        why = ("no summary.json yet" if run.get("stale_summary") is None else
               f"summary.json is from an earlier run in this directory: {run['stale_summary']} steps")
        status = run.get("status") or ("running", "")
        state, why = ("in progress", why) if status[0] == "running" else status
        lines += [f"**Status: {state}** ({why}). Last logged: step {last['step']}, epoch "
                  f"{epoch_number(last)}, loss {_fmt(last.get('loss'))}"
                  + (f", val_accuracy {val[-1]['val_accuracy']:.4f} after epoch {epoch_number(val[-1])}"
                     if val else ", val_accuracy not measured yet (no epoch finished)") + ".", ""]
        speeds = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
        if speeds:
            lines += [f"Throughput so far: median {statistics.median(speeds):,.0f} samples/s over "
                      f"{len(speeds)} logged window{'s' if len(speeds) != 1 else ''}.", ""]
    else:
        keys = ["world_size", "epochs", "steps", "global_batch_size", "train_loss", "val_loss", "val_accuracy",
                "val_perplexity", "val_bits_per_byte", "samples_per_s", "tokens_per_s", "mfu", "flops_per_token",
                "peak_flops", "precision", "zero", "train_time_s", "ranks_in_sync", "resumed_from", "model", "data"]
        lines += ["**Status: finished** (summary.json).", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {_fmt(summary[k])} |" for k in keys if k in summary]
        lines.append("")
        speeds = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
        if speeds and summary.get("samples_per_s"):  # two figures of one run that differ: say why
            lines += [f"samples_per_s ({summary['samples_per_s']:,.0f}) is the whole run's: every sample trained "
                      "over the training time (validation and checkpoint stalls left out, `paused_s`), slow windows "
                      f"included; the throughput plot's median ({statistics.median(speeds):,.0f}) is that of a "
                      "typical logged window.", ""]
    if config:
        picked = ["model", "optimizer", "lr", "batch_size", "schedule", "epochs", "grad_compression"]
        shown = ", ".join(f"{k} {config[k]}" for k in picked if k in config)
        if shown:
            link = Path(os.path.relpath(run["run_dir"] / "config.toml", out_dir)).as_posix()
            lines += [f"Config: {shown} ([config.toml]({link})).", ""]

    ends = epochs(metrics)
    if ends:
        lines += ["## Epochs", ""]
        if len(ends) > _TABLE_ROWS:
            lines += [f"The last {_TABLE_ROWS} of {len(ends)} epochs:", ""]
        lines += ["| epoch | step | train loss | val_loss | val_accuracy |", "|---:|---:|---:|---:|---:|"]
        for m in ends[-_TABLE_ROWS:]:
            cells = [epoch_number(m), m["step"], m.get("epoch_train_loss"), m.get("val_loss"), m.get("val_accuracy")]
            lines.append("| " + " | ".join("" if c is None else (f"{c:.4f}" if isinstance(c, float) else str(c))
                                           for c in cells) + " |")
        lines.append("")

    ranks = run["ranks"]
    if ranks:
        means = {r: rank_means(recs) for r, recs in ranks.items()}
        order = sorted(ranks)
        lines += ["## Time per step by rank", ""]
        if len(order) > _TABLE_ROWS:
            order = sorted(order, key=lambda r: -sum(means[r].values()))[:_TABLE_ROWS]
            lines += [f"The {_TABLE_ROWS} slowest of {len(ranks)} ranks (mean ms per step):", ""]
        lines += ["| rank | compute ms | comm ms | data ms | comm share |", "|---:|---:|---:|---:|---:|"]
        for r in order:
            m = means[r]
            total = sum(m.values()) or 1.0
            lines.append(f"| {r} | {m['compute']:.3f} | {m['comm']:.3f} | {m['data']:.3f} | "
                         f"{100 * m['comm'] / total:.0f}% |")
        lines.append("")

    lines += ["## Plots", ""]
    captions = {"loss": "Training and validation loss", "accuracy": "Validation accuracy per epoch",
                "throughput": "Throughput (samples/s)", "timing": "Compute, communication and data time per rank"}
    for key, name in PLOTS.items():
        lines += [f"### {captions[key]}", "", f"![{captions[key]}]({name})", ""]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------------------

def report(run_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Write the PNG plots and report.md of RUN into out_dir (default RUN/report); return the written paths,
    and under `findings` the straggler verdict and the line-up of a hang as one line each (tracereport).

    Works on a finished run, on one still in progress or ended without a summary, on one that hung before it
    logged a step (its flight records), and on a run of your own loop that recorded a timeline and no metrics
    (`hpctrain.Timeline`). Bad input (no RUN, no metrics yet and no flight record or timeline, an out_dir that
    is a file) raises before anything is written.
    """
    from .tracereport import hang_found, trace_report

    run_dir = Path(run_dir)
    hung = timeline_only = False
    try:
        run: dict[str, Any] | None = load_run(run_dir)
    except DataError:
        hung = hang_found(run_dir)
        timeline_only = not hung and any((run_dir / "trace").glob("rank-*.json"))
        if not hung and not timeline_only:
            raise
        run = None  # the flight records of a run that hung before its first logged step, or a library run's timeline
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {str(out_dir)!r} is a file: pass a directory for the report")
    out_dir.mkdir(parents=True, exist_ok=True)
    title = run_dir.resolve().name or str(run_dir)
    if run is None:
        title += " (ended before its first logged step)" if hung else " (a timeline, no metrics)"
    elif run["summary"] is None:
        run["status"] = run_status(run)
        title += f" ({'in progress' if run['status'][0] == 'running' else run['status'][0]})"
    written: dict[str, Any] = {key: out_dir / name for key, name in PLOTS.items()}
    plot_loss(run["metrics"] if run else [], written["loss"], title)
    plot_accuracy(run["metrics"] if run else [], written["accuracy"], title)
    plot_throughput(run["metrics"] if run else [], written["throughput"], title)
    plot_timing(run["ranks"] if run else {}, written["timing"], title)
    lines, pngs, findings = trace_report(run_dir, out_dir, title)
    written.update(pngs)
    written["report"] = out_dir / "report.md"
    text = render_markdown(run, out_dir) if run else f"# Run report: `{run_dir}`\n\n" + (
        "**Status: ended before its first logged step.**\n" if hung else
        "**No metrics.jsonl**: not a `hpctrain train` run. A run of your own loop (the library API) records what it "
        "asks for; here, its timeline (`hpctrain.Timeline`).\n")
    write_text(written["report"], text + "\n" + "\n".join(lines))
    written["findings"] = findings
    return written
