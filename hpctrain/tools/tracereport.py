"""What `hpctrain report RUN` adds from the timeline and the flight recorder: the straggler verdict with a PNG of
every rank's phase times over the traced steps and of the arrival skew at each collective, and, after a hang,
the ranks' flight records lined up (the first collective where they diverge, who never arrived).

A run that ended without merging its timeline (stopped, aborted) is merged here from what its ranks wrote
(RUN/trace/rank-NNNN.json -> RUN/trace.json). Flight records are lined up when they are newer than the run's
summary (an earlier, finished run's summary says nothing about them).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from ..trace.chrome import clock_summary, merge, read_ranks
from ..trace.lineup import line_up, read_dumps
from ..trace.straggler import TP_SUMS, analyse, collectives, phase_times
from .figures import by_rank, legend_outside, new_figure, note_empty, save_png

STRAGGLER_PNG = "straggler.png"
_SHOWN = ("data wait", "forward", "backward", "wait", "optimizer")


def _shown(found: dict[str, Any]) -> tuple[str, ...]:
    """The phases the table and the plot show: a pipeline's waits for its neighbours, and the time inside
    tensor-parallel sums, too where the run has them."""
    extra = ("pipeline wait",) if found.get("stages", 1) > 1 else ()
    if any(p.get(TP_SUMS, 0.0) > 0 for p in found["phase_ms"]):
        extra += (TP_SUMS,)
    return _SHOWN + extra


def hang_found(run_dir: Path) -> bool:
    """Whether RUN holds flight records newer than its summary (a job that hung or failed)."""
    dumps = list((Path(run_dir) / "logs").glob("rank-*.flight.json"))
    summary = Path(run_dir) / "summary.json"
    return bool(dumps) and (not summary.is_file() or max(p.stat().st_mtime for p in dumps) > summary.stat().st_mtime)


def trace_report(run_dir: Path, out_dir: Path, title: str) -> tuple[list[str], dict[str, Path], list[str]]:
    """(report.md's lines, the PNGs written, one line per finding for the console) for RUN's timeline and
    flight records; all empty when RUN has neither."""
    lines: list[str] = []
    written: dict[str, Path] = {}
    findings: list[str] = []
    if hang_found(run_dir):
        dumps, beats, world = read_dumps(Path(run_dir) / "logs")
        found = line_up(world, dumps, beats)
        findings.append(f"flight records: {found['text']}")
        lines += ["## Hang: the flight records lined up", "", found["text"] + ".", ""]
        lines += [f"- rank {r}: {why}" for r, why in sorted(found["reasons"].items()) if why]
        lines += ["", "Each rank's record: `RUN/logs/rank-NNNN.flight.json` (its last collectives, oldest first).", ""]
    docs = read_ranks(Path(run_dir) / "trace")
    if docs:
        trace_json = Path(run_dir) / "trace.json"
        newest = max(p.stat().st_mtime for p in (Path(run_dir) / "trace").glob("rank-*.json"))
        if not trace_json.is_file() or trace_json.stat().st_mtime < newest:
            merge(run_dir)  # a run that stopped or failed before its end merged nothing
        found = analyse(docs)
        findings.append(f"straggler: {found['verdict']}")
        written["straggler"] = out_dir / STRAGGLER_PNG
        plot_straggler(docs, found, written["straggler"], title)
        lines += _timeline_lines(docs, found, trace_json)
    return lines, written, findings


def _timeline_lines(docs: list[dict[str, Any]], found: dict[str, Any], trace_json: Path) -> list[str]:
    clock, shown = clock_summary(docs), _shown(found)
    skew = found["arrival_skew_ms"]
    lines = ["## Timeline (--trace)", "", f"**{found['verdict']}.**", "",
             f"{len(docs)} ranks, window {docs[0].get('window')}: {found['steps']} steps, {found['collectives']} "
             f"collectives every rank of their communicator recorded whole; arrival skew (last minus first rank) "
             f"median {skew['median']:.2f} "
             f"ms, 90th percentile {skew['p90']:.2f} ms, max {skew['max']:.2f} ms. Clocks against rank 0: offsets up "
             f"to {clock['offset_max_us']:.1f} us, each measured within {clock['error_max_us']:.1f} us, drift "
             f"{clock['drift_max_us']:.1f} us. Open `{trace_json}` in https://ui.perfetto.dev.", "",
             f"![Phase times and arrival skew]({STRAGGLER_PNG})", "",
             "| rank | " + " | ".join(f"{p} ms" for p in shown) + " | made others wait ms/step | in | last to arrive |",
             "|---:|" + "---:|" * (len(shown) + 1) + "---|---:|"]
    waits = found["made_others_wait_ms_per_step"]
    order = sorted(range(len(docs)), key=lambda r: -waits[r])[:10]
    for r in sorted(order):
        phases = found["phase_ms"][r]
        by_phase = found["made_others_wait_by_phase_ms_per_step"][r]
        where = ", ".join(f"{p} {ms:.2f}" for p, ms in sorted(by_phase.items(), key=lambda kv: -kv[1]) if ms >= 0.01)
        lines.append(f"| {docs[r]['rank']} | " + " | ".join(f"{phases[p]:.2f}" for p in shown)
                     + f" | {waits[r]:.2f} | {where} | {found['last_arrivals'][r]} |")
    return lines + [""]


def plot_straggler(docs: list[dict[str, Any]], found: dict[str, Any], path: Path, title: str) -> None:
    """Per rank, each phase's ms over the traced steps (a line per rank up to 8, else the median and the range
    of all), and the arrival skew of each collective over the steps."""
    fig = new_figure(11.0, 7.0)
    shown = _shown(found)
    grid = fig.add_gridspec(2, len(shown))
    times = [phase_times(d) for d in docs]
    for col, phase in enumerate(shown):
        series = {d["rank"]: (sorted(t), [t[s][phase] * 1e3 for s in sorted(t)]) for d, t in zip(docs, times)}
        by_rank(fig.add_subplot(grid[0, col]), series, phase, "ms" if col == 0 else None)
    legend_outside(fig, fig.axes[:1], "outside right upper")
    ax = fig.add_subplot(grid[1, :])
    colls = collectives(docs)
    if not colls:
        note_empty(ax, "no collective recorded whole by every rank of its communicator")
    else:
        last = [c["ranks"][max(range(len(c["arrive"])), key=c["arrive"].__getitem__)] for c in colls]
        ax.scatter([c["step"] for c in colls], [(max(c["arrive"]) - min(c["arrive"])) * 1e3 for c in colls],
                   c=[f"C{r % 10}" for r in last], s=12)
        ax.set_xlabel("step")
        ax.set_ylabel("arrival skew, ms (color: the last rank)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(textwrap.fill(found["verdict"], 150), fontsize=9)
    fig.suptitle(f"Phase times by rank and arrival skew: {title}")
    save_png(fig, path)
