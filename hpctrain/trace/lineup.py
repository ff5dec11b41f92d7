"""The flight records of every rank lined up after a hang: where the ranks of each communicator diverge, who was
inside, who never arrived, which point-to-point transfer a pipeline stage waits for and the rank that never
sent it, and what the heartbeat of a rank that left no record says. Pure functions of the dumps
(RUN/logs/rank-NNNN.flight.json) and heartbeats (RUN/logs/rank-NNNN.heartbeat); `read_dumps` reads them.

Every member of a communicator enters its collectives in the same order and numbers them as it enters
(`flight`: the group's own sequence number), so number s of a group is the same collective on each of its
members, whichever other groups (a data-parallel, a tensor-parallel group) each rank also takes part in. A
group is known by its name and its members (ranks of the run), as each rank's dump lists them. Walking s up
from the oldest record every member still holds, the first s that is not finished on every member, or that
some member never entered, or that is another operation on another member, is where that group stopped
agreeing. A transfer is matched with its peer's by its channel's number: a receive a rank is blocked on whose
sender never posted the send is the stuck transfer, and that sender is named (with what it was doing). When
several findings lead to ranks that wait for no one, those are named first: the ranks the job waits for.

A rank that was stopped (SIGSTOP) and continued by mpirun's teardown (SIGCONT, then SIGTERM) dumps too, but
late and looking innocent: its watchdog noticed that the process did not run (`frozen_s`), and that is named.
Dumps written before groups existed (no `groups`) line up as one world, numbered by `seq`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FROZEN_S = 2.0  # a rank whose watchdog saw its own process not run this long is named (stopped, starved) ...
RECENT_S = 10.0  # ... when that ended this close to its dump or last beat (a stall long before says nothing)
OLD_FIELDS = ("seq", "op", "bucket", "bytes", "dtype", "phase", "step", "enqueue", "start", "end", "thread")
Group = tuple[str, tuple[int, ...]]  # a communicator as the line-up knows it: its name and its members


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


def records(doc: dict[str, Any], world: int, rows: list[list[Any]] | None = None
            ) -> tuple[list[dict[str, Any]], dict[Group, int]]:
    """One rank's records (a flight dump's, or `rows` of its timeline file) as dicts, each with its communicator
    as a `Group`, and {group: collectives entered} (of the registration of a group whose records are the
    newest: a process can hold an earlier run's)."""
    fields = doc.get("fields") or OLD_FIELDS
    table = doc.get("groups") or [{"name": "world", "ranks": None, "entered": doc.get("entered", 0)}]
    groups = [(str(g.get("name", "world")), tuple(range(world)) if g.get("ranks") is None else tuple(g["ranks"]))
              for g in table]
    recs = []
    for raw in doc.get("records", []) if rows is None else rows:
        rec = {"group": 0, "peer": -1, "micro": -1, **dict(zip(fields, raw))}
        rec.setdefault("gseq", rec["seq"])
        rec["gid"] = rec["group"] if 0 <= rec["group"] < len(groups) else 0
        rec["group"] = groups[rec["gid"]]
        recs.append(rec)
    newest: dict[int, int] = {}
    for rec in recs:
        newest[rec["gid"]] = max(newest.get(rec["gid"], -1), rec["seq"])
    chosen: dict[Group, int] = {}
    for gid, group in enumerate(groups):
        if group not in chosen or (newest.get(gid, -1), gid) > (newest.get(chosen[group], -1), chosen[group]):
            chosen[group] = gid
    recs = [rec for rec in recs if chosen[rec["group"]] == rec["gid"]]
    entered = {group: int(table[gid].get("entered", 0)) for group, gid in chosen.items()}
    for rec in recs:  # a count written by two threads at once can lag its records
        if rec["peer"] < 0:
            entered[rec["group"]] = max(entered[rec["group"]], rec["gseq"] + 1)
    return recs, entered


def _label(group: Group, world: int) -> str:
    """How the text names a group's collectives: "the ranks" for the world's, "ranks 0, 1 of the data-parallel
    group" for another's."""
    name, ranks = group
    if name == "world" and ranks == tuple(range(world)):
        return "the ranks"
    return f"{_ranks(list(ranks))} of the {name}"


def _describe(rec: dict[str, Any], group: bool = False) -> str:
    what = rec["op"] if rec["bucket"] < 0 else f"{rec['op']} of bucket {rec['bucket']}"
    if rec["peer"] >= 0:
        what += f" {'to' if rec['op'].startswith('send') else 'from'} rank {rec['peer']}"
    if rec["micro"] >= 0:
        what += f" of micro-batch {rec['micro']}"
    if group and rec["group"][0] != "world":
        what += f" (on the {rec['group'][0]})"
    size = f", {rec['bytes'] / 1e6:.2f} MB" if rec["bytes"] else ""
    dtype = f"{rec['dtype']}{size}" if rec["dtype"] else size.lstrip(", ")
    return f"#{rec['gseq']} {what}" + (f" ({dtype})" if dtype else "") + f" at step {rec['step']}" + (
        f" ({rec['phase']})" if rec["phase"] else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def line_up(world: int, dumps: dict[int, dict[str, Any]], beats: dict[int, dict[str, Any]],
            now: float | None = None) -> dict[str, Any]:
    """Where the ranks diverge: {seq, collective, finished, waiting, missing (of the first group that
    diverges), groups, transfers, culprits, no_record, frozen, reasons, text}. `now`: the time (time.time())
    against which a heartbeat's silence is measured; by default the latest dump's, the moment the job was
    ending (a report may be made long after)."""
    if now is None:
        now = max((float(d.get("time", 0.0)) for d in dumps.values()),
                  default=max((float(b.get("time", 0.0)) for b in beats.values()), default=0.0))
    have = sorted(r for r in dumps if r < world)
    no_record = [r for r in range(world) if r not in dumps]
    frozen = {r: s for r in range(world) if (s := _frozen(dumps.get(r), beats.get(r))) >= FROZEN_S}
    out: dict[str, Any] = {"seq": None, "collective": None, "finished": [], "waiting": [], "missing": [],
                           "groups": [], "transfers": [], "culprits": [], "no_record": no_record,
                           "frozen": sorted(frozen), "reasons": {r: dumps[r].get("reason") for r in have}}
    notes = [f"rank {r} did not run for {s:.0f} s (stopped, or starved of CPU): the others waited for it"
             for r, s in sorted(frozen.items())]
    notes += [_silence(r, beats.get(r), now) for r in no_record]
    if not have:
        out["text"] = "no rank left a flight record" + (": " + "; ".join(notes) if notes else "")
        return out
    read = {r: records(dumps[r], world) for r in have}
    recs = {r: read[r][0] for r in have}
    entered: dict[Group, dict[int, int]] = {}
    for r in have:
        for group, n in read[r][1].items():
            if r in group[1]:
                entered.setdefault(group, {})[r] = n
    order = sorted(entered, key=lambda g: (g[0] != "world", g[0], g[1]))
    stuck = _stuck_transfers(dumps, recs, world)
    blocked = {t["rank"]: t["peer"] for t in stuck}
    found = [f for g in order if (f := _diverge(g, world, recs, entered[g], blocked)) is not None]
    if found:
        first = found[0]
        out.update({k: first[k] for k in ("seq", "collective", "bucket", "step", "phase", "finished", "waiting",
                                          "missing")})
    out["groups"], out["transfers"] = found, stuck
    out["culprits"] = culprits = _culprits(found, stuck)
    texts = [t["text"] for t in stuck] + [f["text"] for f in found]
    if not texts:
        world_group = ("world", tuple(range(world)))
        if set(entered) <= {world_group}:
            last = max(entered.get(world_group, {0: 0}).values(), default=0) - 1
            text = f"the flight records of {_ranks(have)} agree up to collective #{last}, every one finished"
        else:
            text = (f"the flight records of {_ranks(have)} agree: every collective of their {len(entered)} "
                    "communicators finished, and no rank waits for a transfer")
    else:
        text = "; ".join(texts)
        if len(texts) > 1 and culprits:
            text = f"the job waits for {_ranks(culprits)}: " + text
    out["text"] = text + ("; " + "; ".join(notes) if notes else "")
    return out


def _diverge(group: Group, world: int, recs: dict[int, list[dict[str, Any]]], entered: dict[int, int],
             blocked: dict[int, int]) -> dict[str, Any] | None:
    """The first collective of `group` where its members that dumped diverge (None: they agree). `blocked`:
    {rank: the peer it waits for in a stuck transfer} (named above: a member that never arrived for that)."""
    have = sorted(entered)
    maps = {r: {rec["gseq"]: rec for rec in recs[r] if rec["group"] == group and rec["peer"] < 0} for r in have}
    lo = max(min(maps[r], default=entered[r]) for r in have)
    label = _label(group, world)
    for seq in range(lo, max(entered.values())):
        rows = {r: maps[r].get(seq) for r in have}
        kinds = {(row["op"], row["bucket"]) for row in rows.values() if row is not None}
        missing = [r for r in have if rows[r] is None]
        waiting = [r for r in have if rows[r] is not None and rows[r]["end"] <= 0]
        base = {"group": group[0], "ranks": list(group[1]), "seq": seq, "waiting": waiting, "missing": missing}
        if len(kinds) > 1:
            return {**base, "collective": None, "bucket": None, "step": None, "phase": None, "finished": [],
                    "text": f"{label} disagree on collective #{seq}: " + "; ".join(
                        f"rank {r} entered {_describe(row)}" for r, row in rows.items() if row is not None)}
        if missing or waiting:
            row = next(row for row in rows.values() if row is not None)
            finished = [r for r in have if r not in missing and r not in waiting]
            parts = [f"{_ranks(finished)} finished it" if finished else "",
                     f"{_ranks(waiting)} entered it and {'was' if len(waiting) == 1 else 'were'} still inside" if waiting else "",
                     f"{_ranks(missing)} never arrived" if missing else ""]
            text = f"{label} diverge at collective {_describe(row)}: " + "; ".join(p for p in parts if p)
            if missing:
                text += " (" + "; ".join(f"rank {r} waits for rank {blocked[r]}, above" if r in blocked
                                         else _last(r, recs[r]) for r in missing) + ")"
            return {**base, "collective": row["op"], "bucket": row["bucket"], "step": row["step"],
                    "phase": row["phase"], "finished": finished, "text": text}
    return None


def _stuck_transfers(dumps: dict[int, dict[str, Any]], recs: dict[int, list[dict[str, Any]]],
                     world: int) -> list[dict[str, Any]]:
    """The transfers a rank is blocked on that its peer never posted (or that did not complete though both
    sides posted them), with the text that names the stage and the rank waited for."""
    out = []
    for r in sorted(recs):
        blocked = set(dumps[r].get("blocked") or ())
        for rec in recs[r]:
            if rec["seq"] not in blocked or rec["peer"] < 0 or rec["end"] > 0:
                continue
            peer, group = rec["peer"], rec["group"]
            verb, what = (rec["op"].split(" ", 1) + [""])[:2]
            other = ("recv " if verb == "send" else "send ") + what
            posted = _posted(dumps.get(peer), world, group, r, other)
            step = (f" of micro-batch {rec['micro']}" if rec["micro"] >= 0 else "") + f" at step {rec['step']}"
            me, them = _who(r, group), _who(peer, group)
            if verb == "recv":
                text = f"{me} waits for the {what}{step} from {them}"
            else:
                text = f"{me} waits for {them} to take the {what}{step}"
            if posted is None:
                text += ", which left no flight record"
            elif posted <= rec["gseq"]:
                text += (", which never sent them" if verb == "recv" else ", which never posted its receive")
                text += _doing(peer, dumps[peer], recs.get(peer, []))
            else:
                text += ", which posted its side: neither completed (a network or MPI problem)"
            out.append({"rank": r, "peer": peer, "op": rec["op"], "micro": rec["micro"], "step": rec["step"],
                        "seq": rec["gseq"], "never_posted": posted is not None and posted <= rec["gseq"],
                        "text": text})
    return out


def _posted(dump: dict[str, Any] | None, world: int, group: Group, peer: int, op: str) -> int | None:
    """How many transfers `op` with `peer` over `group` the rank of `dump` posted (None: no dump)."""
    if dump is None:
        return None
    table = dump.get("groups") or []
    for gid, to, kind, n in dump.get("channels") or []:
        if to == peer and kind == op and 0 <= gid < len(table):
            ranks = table[gid].get("ranks")
            if (table[gid].get("name"), tuple(range(world)) if ranks is None else tuple(ranks)) == group:
                return int(n)
    return 0


def _who(rank: int, group: Group) -> str:
    """"stage 1 (rank 3)" for a rank of a pipeline, else "rank 3"."""
    return f"stage {group[1].index(rank)} (rank {rank})" if group[0] == "pipeline" and rank in group[1] else f"rank {rank}"


def _doing(rank: int, dump: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    """What a rank that others wait for was doing when it dumped: its wait or work, else its last record."""
    if dump.get("phase"):
        return f" (rank {rank} was in {dump['phase']} at step {dump.get('step')})"
    return f" ({_last(rank, recs)})"


def _culprits(found: list[dict[str, Any]], stuck: list[dict[str, Any]]) -> list[int]:
    """The ranks others wait for (never arrived, never sent) that wait for no one themselves."""
    waits = {(w, m) for f in found for w in f["waiting"] for m in f["missing"]}
    waits |= {(t["rank"], t["peer"]) for t in stuck if t["never_posted"]}
    waiters = {w for w, _ in waits}
    return sorted({m for _, m in waits} - waiters)


def _last(rank: int, recs: list[dict[str, Any]]) -> str:
    if not recs:
        return f"rank {rank} recorded no collective"
    rec = max(recs, key=lambda x: x["seq"])
    return f"rank {rank}'s last: {_describe(rec, group=True)}, {'finished' if rec['end'] > 0 else 'unfinished'}"


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
