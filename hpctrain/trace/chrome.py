"""The ranks' timeline files merged into one Chrome trace (RUN/trace.json): ui.perfetto.dev and chrome://tracing
open it. A pure function of the files (`chrome_trace`), the reading of them (`read_ranks`), and the merge of a
run's files into RUN/trace.json with its straggler verdict (`merge`).

One process per rank ("rank R (host)"), one thread lane per host thread that did something (the training
loop, the communication thread, the checkpoint writer, ...). Phases are slices ("X"); each collective is a
slice on the lane that ran it, with its sequence number in its communicator, operation, bucket, bytes, dtype,
step, its communicator when that is not the world (a data-parallel, a tensor-parallel group: named in the
slice, with its ranks), and how long this rank waited in it for the last member to arrive; each bucket's
hand-off to the communication thread is an instant marker; and for every collective an arrow (a flow) runs
from the last member to arrive to each member that waited for it (beyond `FLOW_RANKS` ranks, to the one that
waited longest). A pipeline's point-to-point transfers are async slices of their rank (posted to seen
complete), with an arrow from each send to the receive it met; its micro-batches' forward and backward and
its waits for a neighbour ("pipeline wait") are phases, so the bubble shows as the waits. Times are
microseconds on rank 0's clock (`straggler.aligner`), from the earliest event.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..base.durable import write_text
from ..base.errors import DataError
from .lineup import records
from .straggler import aligner, analyse, collectives

FLOW_RANKS = 16  # up to this many ranks, an arrow to every rank that waited; beyond, to the one that waited longest
_LANE_ORDER = {"MainThread": 1, "hpctrain-comm": 2, "hpctrain-checkpoint": 3}
_LANE_NAMES = {"MainThread": "training loop", "hpctrain-comm": "communication", "hpctrain-checkpoint": "checkpoint writer"}


def read_ranks(directory: Path) -> list[dict[str, Any]]:
    """The timeline files RUN/trace/rank-NNNN.json, in rank order; DataError for one that is not JSON."""
    docs = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{path} is not a timeline file ({exc}): remove it, or trace the run again") from None
        if isinstance(doc, dict) and "steps" in doc:
            docs.append(doc)
    return sorted(docs, key=lambda d: d["rank"])


class _Lanes:
    """Small thread ids per (rank, host thread), named once with metadata events."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events, self.ids, self.next = events, {}, {}

    def tid(self, doc: dict[str, Any], ident: int) -> int:
        key = (doc["rank"], ident)
        if key not in self.ids:
            name = doc.get("threads", {}).get(str(ident), f"thread {ident}")
            if ident == doc.get("main"):
                name = "MainThread"
            tid = _LANE_ORDER.get(name) or 10 + self.next.setdefault(doc["rank"], 0)
            if name not in _LANE_ORDER:
                self.next[doc["rank"]] += 1
            self.ids[key] = tid
            self.events.append({"ph": "M", "name": "thread_name", "pid": doc["rank"], "tid": tid,
                                "args": {"name": _LANE_NAMES.get(name, name)}})
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": doc["rank"], "tid": tid,
                                "args": {"sort_index": tid}})
        return self.ids[key]


def chrome_trace(docs: list[dict[str, Any]], straggler: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace (a dict to dump as JSON) of the ranks' timeline files `docs`, in rank order."""
    events: list[dict[str, Any]] = []
    lanes = _Lanes(events)
    aligns = {d["rank"]: aligner(d) for d in docs}
    starts = [aligns[d["rank"]](s[2]) for d in docs for step in d["steps"] for s in step["spans"]]
    starts += [aligns[d["rank"]](min(r[7], r[8])) for d in docs for step in d["steps"] for r in step.get("collectives", [])]
    starts += [aligns[d["rank"]](s[2]) for d in docs for s in d.get("startup", [])]
    origin = min(starts, default=0.0)

    def us(doc: dict[str, Any], t: float) -> float:
        return round((aligns[doc["rank"]](t) - origin) * 1e6, 3)

    for doc in docs:
        rank = doc["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({doc.get('host', '?')})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for step in [{"step": 0, "spans": doc.get("startup", []), "collectives": []}, *doc["steps"]]:
            for name, ident, start, end, args in step["spans"]:
                events.append({"ph": "X", "name": name, "cat": "phase", "pid": rank, "tid": lanes.tid(doc, ident),
                               "ts": us(doc, start), "dur": round(max(us(doc, end) - us(doc, start), 0.0), 3),
                               "args": {"step": step["step"], **(args or {})}})
    _collective_events(docs, events, lanes, us)
    meta = {"hpctrain_trace": 1, "ranks": len(docs), "window": docs[0].get("window") if docs else None,
            "clock": [{"rank": d["rank"], **(d.get("clock") or {})} for d in docs]}
    if straggler is not None:
        meta["straggler"] = straggler.get("verdict")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def _collective_events(docs: list[dict[str, Any]], events: list[dict[str, Any]], lanes: _Lanes, us: Any) -> None:
    """Every collective as a slice on its lane, its hand-off as an instant, and arrows from the last member of its
    communicator to arrive to the members that waited for it (not for the tensor-parallel sums inside each
    micro-batch's forward and backward: hundreds a step; their slices name the last rank and the wait); every
    point-to-point transfer as an async slice of its rank, from posted to seen complete, with an arrow from
    the send to the receive it met."""
    by_rank = {d["rank"]: d for d in docs}
    matched = {(c["group"], tuple(c["ranks"]), c["seq"]): c for c in collectives(docs)}
    recs = {d["rank"]: records(d, len(docs), [r for step in d["steps"] for r in step.get("collectives", [])])[0]
            for d in docs}
    for doc in docs:
        for rec in recs[doc["rank"]]:
            if rec["peer"] >= 0:
                _transfer_events(doc, rec, events, us)
            else:
                _collective_slice(doc, rec, matched.get((*rec["group"], rec["gseq"])), events, lanes, us)
    flow = 0
    rows = {rank: {(r["group"], r["gseq"]): r for r in rs if r["peer"] < 0} for rank, rs in recs.items()}
    for c in matched.values():
        if c["micro"] >= 0:  # a tensor-parallel sum inside a micro-batch: hundreds a step, its slice says who was last
            continue
        order = c["ranks"]
        last = order[max(range(len(order)), key=c["arrive"].__getitem__)]
        waiters = [r for r in order if r != last]
        if len(order) > FLOW_RANKS:  # many ranks: one arrow, to the rank that waited longest
            waiters = [order[min(range(len(order)), key=c["arrive"].__getitem__)]]
        key = ((c["group"], tuple(order)), c["seq"])
        src, row = by_rank[last], rows[last][key]
        for waiter in waiters:
            wdoc, wrow = by_rank[waiter], rows[waiter][key]
            flow += 1
            released = min(max(us(wdoc, wrow["start"]), us(src, row["start"])), us(wdoc, wrow["end"]))  # inside its slice
            events.append({"ph": "s", "id": flow, "name": "waited for", "cat": "arrival", "pid": last,
                           "tid": lanes.tid(src, row["thread"]), "ts": us(src, row["start"])})
            events.append({"ph": "f", "bp": "e", "id": flow, "name": "waited for", "cat": "arrival", "pid": waiter,
                           "tid": lanes.tid(wdoc, wrow["thread"]), "ts": released})
    _transfer_flows(by_rank, recs, events, lanes, us, flow)


def _collective_slice(doc: dict[str, Any], rec: dict[str, Any], c: dict[str, Any] | None, events: list[dict[str, Any]],
                      lanes: _Lanes, us: Any) -> None:
    """One collective of one rank: a slice on its lane (and its bucket's hand-off, an instant)."""
    rank, tid = doc["rank"], lanes.tid(doc, rec["thread"])
    name = rec["op"] if rec["bucket"] < 0 else f"{rec['op']} bucket {rec['bucket']}"
    args = {"seq": rec["gseq"], "op": rec["op"], "bucket": rec["bucket"], "bytes": rec["bytes"], "dtype": rec["dtype"],
            "phase": rec["phase"], "step": rec["step"]}
    group, members = rec["group"]
    if group != "world" or members != tuple(range(len(members))):
        name += f" ({group})"
        args.update(group=group, ranks=list(members))
    if rec["micro"] >= 0:  # a tensor-parallel sum: its phase is the forward or backward slice around it
        args["micro"] = rec["micro"]
        del args["phase"]
    if c is not None:
        mine, last = c["arrive"][c["ranks"].index(rank)], max(c["arrive"])
        args.update(waited_for_last_ms=round((last - mine) * 1e3, 4), last_rank=c["ranks"][c["arrive"].index(last)])
    start, end = rec["start"], rec["end"]
    if end <= 0:  # unfinished: a zero-length slice, marked
        args["unfinished"], end = True, start
    events.append({"ph": "X", "name": name, "cat": "collective", "pid": rank, "tid": tid, "ts": us(doc, start),
                   "dur": round(max(us(doc, end) - us(doc, start), 0.0), 3), "args": args})
    if rec["enqueue"] < start - 1e-6:
        events.append({"ph": "i", "s": "t", "name": f"hand-off bucket {rec['bucket']}", "cat": "hand-off", "pid": rank,
                       "tid": tid, "ts": us(doc, rec["enqueue"]), "args": {"seq": rec["gseq"], "step": rec["step"]}})


def _transfer_events(doc: dict[str, Any], rec: dict[str, Any], events: list[dict[str, Any]], us: Any) -> None:
    """A point-to-point transfer: an async slice of its rank (its own track, beside the threads' lanes), from
    posted to seen complete (a send is seen complete when its stage waits for its sends, at the end of its
    schedule)."""
    rank = doc["rank"]
    verb = "to" if rec["op"].startswith("send") else "from"
    micro = f" of micro-batch {rec['micro']}" if rec["micro"] >= 0 else ""
    args = {"seq": rec["gseq"], "op": rec["op"], "peer": rec["peer"], "micro": rec["micro"], "bytes": rec["bytes"],
            "dtype": rec["dtype"], "step": rec["step"], "phase": rec["phase"], "group": rec["group"][0]}
    end = rec["end"]
    if end <= 0:
        args["unfinished"], end = True, rec["start"]
    common = {"cat": "point-to-point", "name": f"{rec['op']}{micro} {verb} rank {rec['peer']}", "pid": rank,
              "id": f"{rank}.{rec['seq']}"}
    events.append({"ph": "b", **common, "ts": us(doc, rec["start"]), "args": args})
    events.append({"ph": "e", **common, "ts": us(doc, max(end, rec["start"]))})


def _transfer_flows(by_rank: dict[int, dict[str, Any]], recs: dict[int, list[dict[str, Any]]],
                    events: list[dict[str, Any]], lanes: _Lanes, us: Any, flow: int) -> None:
    """An arrow from each send (where the sender posted it, inside its forward or backward) to the receive it met
    (where the receiver saw it complete, inside its wait for it): the n-th send of a channel meets the peer's
    n-th receive of it."""
    received = {(r["peer"], rank, r["op"].removeprefix("recv "), r["gseq"]): r
                for rank, rs in recs.items() for r in rs if r["peer"] >= 0 and r["op"].startswith("recv")}
    for rank, rs in recs.items():
        for send in rs:
            if send["peer"] < 0 or not send["op"].startswith("send"):
                continue
            recv = received.get((rank, send["peer"], send["op"].removeprefix("send "), send["gseq"]))
            if recv is None or recv["end"] <= 0 or send["peer"] not in by_rank:
                continue
            src, dst = by_rank[rank], by_rank[send["peer"]]
            flow += 1
            events.append({"ph": "s", "id": flow, "name": send["op"].removeprefix("send "), "cat": "transfer",
                           "pid": rank, "tid": lanes.tid(src, send["thread"]), "ts": us(src, send["start"])})
            events.append({"ph": "f", "bp": "e", "id": flow, "name": send["op"].removeprefix("send "), "cat": "transfer",
                           "pid": send["peer"], "tid": lanes.tid(dst, recv["thread"]), "ts": us(dst, recv["end"])})


def clock_summary(docs: list[dict[str, Any]]) -> dict[str, float]:
    """The clocks of the ranks against rank 0's, in microseconds: the largest offset measured (at start or end),
    the largest error bound of a measurement (half its round trip), and the largest change between start and
    end (drift, corrected by interpolation). On one node all ranks read one clock: the offsets are the error."""
    clocks = [d.get("clock") or {} for d in docs]
    offsets = [abs(c.get(k, 0.0)) for c in clocks for k in ("offset", "offset_end")]
    errors = [c.get(k, 0.0) for c in clocks for k in ("error", "error_end")]
    drift = [abs(c.get("offset_end", c.get("offset", 0.0)) - c.get("offset", 0.0)) for c in clocks]
    return {"offset_max_us": max(offsets, default=0.0) * 1e6, "error_max_us": max(errors, default=0.0) * 1e6,
            "drift_max_us": max(drift, default=0.0) * 1e6}


def merge(run_dir: Path) -> dict[str, Any]:
    """RUN/trace/rank-*.json merged into RUN/trace.json; returns summary.json's `trace` and `straggler`
    entries (empty when no rank wrote a timeline)."""
    run_dir = Path(run_dir)
    docs = read_ranks(run_dir / "trace")
    if not docs:
        return {}
    found = analyse(docs)
    path = run_dir / "trace.json"
    text = json.dumps(chrome_trace(docs, found), separators=(",", ":"))
    write_text(path, text)
    trace = {"file": path.name, "bytes": len(text.encode()), "ranks": len(docs), "window": docs[0].get("window"),
             "steps": found["steps"], "collectives": found["collectives"], "clock": clock_summary(docs)}
    return {"trace": trace, "straggler": brief(found)}


def brief(found: dict[str, Any]) -> dict[str, Any]:
    """The straggler analysis without its per-rank lists (summary.json stays small at any world size), with
    the five ranks that made the others wait longest."""
    waits = found["made_others_wait_ms_per_step"]
    top = sorted(range(len(waits)), key=lambda r: -waits[r])[:5]
    keep = {k: v for k, v in found.items() if not isinstance(v, list)}
    keep["made_others_wait_ms_per_step"] = {str(r): waits[r] for r in top}
    keep["made_others_wait_by_phase_ms_per_step"] = {str(r): found["made_others_wait_by_phase_ms_per_step"][r]
                                                     for r in top if waits[r] > 0}
    return keep
