"""The flight records of every rank lined up after a hang: the first collective where the ranks diverge, who
was inside it, who never arrived, and what the heartbeat of a rank that left no record says. Pure functions
of the dumps (RUN/logs/rank-NNNN.flight.json) and heartbeats (RUN/logs/rank-NNNN.heartbeat); `read_dumps`
reads them.

Every rank enters the collectives of the job in the same order and numbers them as it enters (`flight`), so
sequence number s is the same collective on every rank. Walking s up from the oldest record every rank
still holds, the first s that is not finished on every rank, or that some rank never entered, or that is
another operation on another rank, is where the job stopped agreeing. A rank that was stopped (SIGSTOP) and
continued by mpirun's teardown (SIGCONT, then SIGTERM) dumps too, but late and looking innocent: its watchdog
noticed that the process did not run (`frozen_s`), and that is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FROZEN_S = 2.0  # a rank whose watchdog saw its own process not run this long is named (stopped, starved) ...
RECENT_S = 10.0  # ... when that ended this close to its dump or last beat (a stall long before says nothing)


def read_dumps(logs: Path, world: int | None = None) -> tuple[dict[int, dict], dict[int, dict], int]:
    """({rank: flight dump}, {rank: last heartbeat}, world size) from RUN/logs; the world size is `world`, or
    the one the dumps name, or one more than the highest rank that left either."""
    dumps, beats = {}, {}
    for kind, into in (("flight.json", dumps), ("heartbeat", beats)):
        for path in Path(logs).glob(f"rank-*.{kind}"):
            try:
                rank = int(path.name.split(".")[0].split("-")[1])
                doc = json.loads(path.read_text())
            except (OSError, ValueError, IndexError):
                continue
            if isinstance(doc, dict):
                into[rank] = doc
    if world is None:
        world = max([int(d.get("world", 0)) for d in dumps.values()], default=0) or max([*dumps, *beats], default=-1) + 1
    beats = {r: b for r, b in beats.items() if r < world}  # an earlier run's, on more ranks
    return dumps, beats, world


def _describe(row: list[Any]) -> str:
    what = row[1] if row[2] < 0 else f"{row[1]} of bucket {row[2]}"
    size = f", {row[3] / 1e6:.2f} MB" if row[3] else ""
    dtype = f"{row[4]}{size}" if row[4] else size.lstrip(", ")
    return f"#{row[0]} {what}" + (f" ({dtype})" if dtype else "") + f" at step {row[6]}" + (
        f" ({row[5]})" if row[5] else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def line_up(world: int, dumps: dict[int, dict[str, Any]], beats: dict[int, dict[str, Any]],
            now: float | None = None) -> dict[str, Any]:
    """Where the ranks diverge: {seq, collective, finished, waiting, missing, no_record, text}. `now`: the
    time (time.time()) against which a heartbeat's silence is measured; by default the latest dump's, the
    moment the job was ending (a report may be made long after)."""
    if now is None:
        now = max((float(d.get("time", 0.0)) for d in dumps.values()),
                  default=max((float(b.get("time", 0.0)) for b in beats.values()), default=0.0))
    have = sorted(r for r in dumps if r < world)
    no_record = [r for r in range(world) if r not in dumps]
    frozen = {r: s for r in range(world) if (s := _frozen(dumps.get(r), beats.get(r))) >= FROZEN_S}
    out: dict[str, Any] = {"seq": None, "collective": None, "finished": [], "waiting": [], "missing": [],
                           "no_record": no_record, "frozen": sorted(frozen),
                           "reasons": {r: dumps[r].get("reason") for r in have}}
    notes = [f"rank {r} did not run for {s:.0f} s (stopped, or starved of CPU): the others waited for it"
             for r, s in sorted(frozen.items())]
    notes += [_silence(r, beats.get(r), now) for r in no_record]
    if not have:
        out["text"] = "no rank left a flight record" + (": " + "; ".join(notes) if notes else "")
        return out
    maps = {r: {row[0]: row for row in dumps[r].get("records", [])} for r in have}
    entered = {r: int(dumps[r].get("entered", 0)) for r in have}
    lo = max(min(maps[r], default=entered[r]) for r in have)
    for seq in range(lo, max(entered.values())):
        rows = {r: maps[r].get(seq) for r in have}
        kinds = {(row[1], row[2]) for row in rows.values() if row is not None}
        missing = [r for r in have if rows[r] is None]
        waiting = [r for r in have if rows[r] is not None and rows[r][9] <= 0]
        if len(kinds) > 1:
            text = f"the ranks disagree on collective #{seq}: " + "; ".join(
                f"rank {r} entered {_describe(row)}" for r, row in rows.items() if row is not None)
            out.update(seq=seq, text=text, waiting=waiting, missing=missing)
            break
        if missing or waiting:
            row = next(row for row in rows.values() if row is not None)
            finished = [r for r in have if r not in missing and r not in waiting]
            parts = [f"{_ranks(finished)} finished it" if finished else "",
                     f"{_ranks(waiting)} entered it and {'was' if len(waiting) == 1 else 'were'} still inside" if waiting else "",
                     f"{_ranks(missing)} never arrived" if missing else ""]
            text = f"the ranks diverge at collective {_describe(row)}: " + "; ".join(p for p in parts if p)
            if missing:
                text += " (" + "; ".join(_last(r, maps[r]) for r in missing) + ")"
            out.update(seq=seq, collective=row[1], bucket=row[2], step=row[6], phase=row[5], finished=finished,
                       waiting=waiting, missing=missing, text=text)
            break
    else:
        out["text"] = (f"the flight records of {_ranks(have)} agree up to collective #{max(entered.values()) - 1}, "
                       "every one finished")
    if notes:
        out["text"] += "; " + "; ".join(notes)
    return out


def _last(rank: int, rows: dict[int, list[Any]]) -> str:
    if not rows:
        return f"rank {rank} recorded no collective"
    row = rows[max(rows)]
    return f"rank {rank}'s last: {_describe(row)}, {'finished' if row[9] > 0 else 'unfinished'}"


def _silence(rank: int, beat: dict[str, Any] | None, now: float) -> str:
    """What the heartbeat of a rank that left no flight record says."""
    if beat is None:
        return f"rank {rank} left no flight record and no heartbeat"
    silent = now - float(beat.get("time", now))
    state = ("its heartbeat is silent for {:.0f} s: stopped, dead or killed".format(silent) if silent > 3
             else "its heartbeat was still beating: alive, it did not dump")
    return (f"rank {rank} left no flight record ({state}; last at step {beat.get('step')}, "
            f"{beat.get('phase') or 'computing'})")


def _frozen(dump: dict[str, Any] | None, beat: dict[str, Any] | None) -> float:
    """How long a rank's watchdog saw its process not run just before the rank's last word (its dump, else its
    heartbeat): stopped and continued by the teardown, or starved; 0 for a stall long before."""
    for doc in (dump, beat):
        if doc and float(doc.get("time", 0)) - float(doc.get("frozen_until") or 0) <= RECENT_S:
            return float(doc.get("frozen_s") or 0)
    return 0.0
