"""How a run without a summary ended, or that nothing says it did (`ended`): what `hpctrain report` calls a run
that is not finished. A run that ends writes summary.json; one that stops writes RUN/stopped.json; one that
fails says why as its rank logs' last record; one that is killed leaves processes that are gone: the pid and
host each rank logs when it starts (checked where the report runs on that host), and the heartbeats that its
ranks rewrite every second (control.watchdog) no longer written (wherever it runs)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

STALE_HEARTBEAT_S = 60.0  # no rank's heartbeat newer than this: the run's processes are gone (or frozen)
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank \d+ ([A-Z]+) (.*)$")
_START = re.compile(r" INFO world \d+, rank \d+, local rank \d+, pid (\d+), host (\S+),")


def ended(run_dir: Path, last_step: int, now: float | None = None) -> tuple[str, str] | None:
    """("stopped" or "ended", why) for a run without a summary, or None when nothing says it ended (in
    progress). `last_step`: its last logged step (a stop record of an earlier stop is older than that)."""
    run_dir = Path(run_dir)
    try:
        stop = json.loads((run_dir / "stopped.json").read_text())
    except (OSError, ValueError):
        stop = None
    if isinstance(stop, dict) and isinstance(stop.get("step"), int) and stop["step"] >= last_step:
        return "stopped", (f"stopped by {stop.get('signal', 'a signal')} at step {stop['step']} (asked by "
                           f"{stop.get('asked_by', '?')}), checkpoint {stop.get('checkpoint', '?')}: run the same "
                           "command to continue")
    logs = sorted((run_dir / "logs").glob("rank-*.log"))
    texts = [_read(path) for path in logs]
    why = [f"error: {e}" for e in [next((e for e in map(_last_error, texts) if e), None)] if e]
    gone = _gone(texts, run_dir / "logs", time.time() if now is None else now)
    if gone:
        why.append(gone)
    return ("ended", "; ".join(why)) if why else None


def _read(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _last_error(lines: list[str]) -> str | None:
    """The message of a rank log's last record when that record is an error (the run's last word)."""
    for line in reversed(lines):
        m = _RECORD.match(line)
        if m:
            return m.group(2) if m.group(1) in ("ERROR", "CRITICAL") else None
    return None


def _gone(texts: list[list[str]], logs: Path, now: float) -> str | None:
    """A line when the run's processes are gone: every rank that logged its start did so on this host and runs
    no more, or no rank has rewritten its heartbeat for STALE_HEARTBEAT_S; else None."""
    starts = [next((m.groups() for m in map(_START.search, reversed(lines)) if m), None) for lines in texts]
    here = socket.gethostname()
    if starts and all(s is not None and s[1] == here and not _running(int(s[0])) for s in starts):
        return f"its processes (pid {', '.join(s[0] for s in starts if s)} on {here}) are gone: aborted or killed"
    beats = []
    for path in logs.glob("rank-*.heartbeat"):
        try:
            beats.append(float(json.loads(path.read_text())["time"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if beats and now - max(beats) > STALE_HEARTBEAT_S:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(beats)))
        return f"no rank has written its heartbeat since {when}: its processes are gone (aborted or killed)"
    return None


def _running(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
