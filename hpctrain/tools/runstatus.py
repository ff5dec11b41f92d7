"""A run's status, from what the trainer leaves in RUN: finished, stopped, failed or running (`run_status`), for
a one-run report and for a comparison of several (one rule for both).

summary.json for the step last logged is finished; RUN/stopped.json (the stop's record, removed when the run
starts again) or a rank's log that says it was stopped (a checkpoint written: `--resume auto` continues it) is
stopped; a rank's log that says training failed (or that a rank
ended the job) is failed. Otherwise the processes tell: when every rank logged its start (pid and host) on
the host the report runs on and none of those processes runs any more, the run is failed (killed, or ended
on an error nothing logged). Where the ranks ran elsewhere, their heartbeat files (RUN/logs/rank-NNNN.heartbeat,
written every second by runs on more than one rank, removed by each rank as it exits) tell them apart: a
fresh one is running, only stale ones (killed ranks, a lost node) or none at all (every rank exited on an
error they agreed on) is failed. A one-rank run on another host writes no heartbeat, so without a summary or
a stop it is reported running, with the age of its newest file to judge by. Only the latest attempt counts: a
resumed run appends to its logs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

HEARTBEAT_STALE_S = 120.0
"""A heartbeat older than this (ranks write one a second) means the rank is gone: killed, or its node lost."""

_FIRST_BEAT_S = 30.0  # a multi-rank attempt writes its first heartbeat a second after its log's first line
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank \d+ [A-Z]+ ")  # runlog.setup_logging's format
# the trainer's first line of an attempt in a rank's log: its world size, and where its process runs
_START = re.compile(r" INFO world (\d+), rank \d+, local rank \d+, pid (\d+), host (\S+), ")
_STOPPED = re.compile(r" WARNING (stopped by \S+ at step \d+(?: \([^)]*\))?); checkpoint written")  # (asked by ...)
_FAILED = re.compile(r" ERROR (training failed|.*; ending the job|.*; aborting the job)$")  # a rank, the watchdog


def _attempt(path: Path) -> tuple[tuple[int, int, str] | None, list[str]]:
    """(world size, pid, host) of the latest attempt in one rank's log (a resumed run appends), and its lines."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = _START.search(lines[i])
        if found:
            return (int(found.group(1)), int(found.group(2)), found.group(3)), lines[i + 1:]
    return None, lines


def _failure(lines: list[str], at: int) -> str:
    """The logged error at lines[at], with the last line of the traceback logged under it (the exception)."""
    why = lines[at].split(" ERROR ", 1)[1]
    below = []
    for line in lines[at + 1:]:
        if _LOG_LINE.match(line):
            break
        below.append(line.strip())
    exception = next((line for line in reversed(below) if line), None)
    return (f"{why}: {exception}" if exception else why)[:300]


def _beat_age(path: Path, now: float) -> float:
    try:
        beat = json.loads(path.read_text())
        return now - float(beat["time"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: judge by when it was written
        return now - path.stat().st_mtime


def _stop_record(path: Path, last_step: int) -> str | None:
    """What RUN/stopped.json says, when it is this attempt's (its step is the last logged one or later)."""
    try:
        stop = json.loads(path.read_text())
        step = int(stop["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if step < last_step:
        return None
    asked = f" (asked by the {stop['asked_by']})" if stop.get("asked_by") else ""
    return f"stopped by {stop.get('signal', 'a signal')} at step {step}{asked}; continue it with --resume auto"


def _gone(starts: list[tuple[int, int, str]]) -> str | None:
    """Why the run's processes are gone, when every rank's started on this host and none runs; else None."""
    here = socket.gethostname()
    if not starts or any(host != here or _running(pid) for _, pid, host in starts):
        return None
    pids = ", ".join(str(pid) for _, pid, _ in starts)
    return (f"its processes (pid {pids} on {here}) are gone without summary.json, a stop or a logged error: "
            "killed, or ended on an error (see RUN/logs and the job's output)")


def _running(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def run_status(run: dict[str, Any], now: float | None = None) -> tuple[str, str]:
    """(status, why) of a run read by `report.load_run`: finished, failed, stopped or running (see the module
    doc). `now` is the time to judge heartbeats against (default: the clock)."""
    if run["summary"] is not None:
        return "finished", "summary.json"
    stop = _stop_record(Path(run["run_dir"]) / "stopped.json", run["metrics"][-1]["step"] if run["metrics"] else 0)
    if stop:
        return "stopped", stop
    now = time.time() if now is None else now
    logs = Path(run["run_dir"]) / "logs"
    first = _attempt(logs / "rank-0000.log")[0] if (logs / "rank-0000.log").is_file() else None
    world = first[0] if first else None

    def current(path: Path) -> bool:  # logs of ranks beyond this attempt's world size are an earlier run's
        try:
            return world is None or int(path.name.split(".")[0].split("-")[1]) < world
        except (IndexError, ValueError):
            return False

    stopped, starts = None, []
    for path in sorted(p for p in logs.glob("rank-*.log") if current(p)):
        start, lines = _attempt(path)
        starts.append(start)
        for i, line in enumerate(lines):
            if _FAILED.search(line):
                return "failed", _failure(lines, i)
            stopped = stopped or _STOPPED.search(line)
    if stopped:
        return "stopped", f"{stopped.group(1)}; continue it with --resume auto"
    gone = _gone(starts) if world is not None and len(starts) == world and None not in starts else None
    if gone:
        return "failed", gone
    ages = [_beat_age(p, now) for p in logs.glob("rank-*.heartbeat") if current(p)]
    if ages and min(ages) <= HEARTBEAT_STALE_S:
        return "running", f"heartbeat {max(0.0, min(ages)):.0f} s ago"
    if ages:
        return "failed", (f"no heartbeat for {min(ages):.0f} s and no summary.json: its ranks were killed, or "
                          "their node lost (see RUN/logs and the job's output)")
    files = [p for p in (Path(run["run_dir"]) / "metrics.jsonl", *logs.glob("rank-*.log")) if p.is_file()]
    idle = now - max(p.stat().st_mtime for p in files)
    if world is not None and world > 1 and idle > _FIRST_BEAT_S:  # every rank exited and removed its heartbeat
        return "failed", ("its ranks exited without summary.json, a stop or a logged error (see RUN/logs and "
                          "the job's output)")
    return "running", f"no summary.json yet; last written {max(0.0, idle):.0f} s ago"
