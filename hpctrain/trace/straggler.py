"""Straggler attribution over the traced window: who arrived last at each collective, how long the others waited
for it, in which phase it lost that time, and one verdict. Pure functions of the ranks' timeline files.

Every rank's times are put on rank 0's clock first (`aligner`: the offsets measured at start and end,
interpolated). Then, for each collective every rank recorded in full (matched by sequence number, which
the flight recorder gives in the order of entry): each rank's arrival, the last rank, and the time the
others waited for it (the median of their waits). The wait is the last rank's doing; it is split between
the phases of that step in which the last rank was slower than the median of the other ranks, in
proportion to how much slower.

Phase times are each rank's median over the steps. A rank is named the straggler when it made the others
wait the longest in most steps (at least 1/2 + 1/(2W) of them: 3/4 with two ranks, 5/8 with four, more than
half with many; on a busy node every rank is late now and then, a straggler is late step after step) and
that waiting is not noise (at least `MIN_EFFECT` of the median step, and `MIN_WAIT_S`); the phase named is
the one where it is furthest behind the median of the other ranks, if that explains a quarter of the
waiting at least. Only collectives whose arrivals can show a straggler count (`comparable`: not a root's
gathers and broadcasts, not validation, checkpoint writes or start-up, where the ranks' shares of the work
differ by design).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

MIN_EFFECT = 0.10  # the straggler's waiting per step, as a fraction of the median step, below which it is noise
MIN_WAIT_S = 0.001  # and in seconds: a rank's own bookkeeping (rank 0 logs, checks the checkpoint policy) is less
# collectives whose arrivals say nothing about a straggler: a root's own work comes first by design (gathers and
# broadcasts of a checkpoint's completion), or each rank's share of the work differs (validation, start-up)
ROOTED = ("gather", "bcast")
UNEVEN = ("checkpoint write", "validation", "start-up", "summary", "clock")
# the phases of a step that can make a rank late (the exposed wait for the gradients is a rank's waiting, not its work)
BLAMED = ("data wait", "zero", "forward", "backward", "optimizer", "validation", "checkpoint stall")
STEP_PHASES = BLAMED + ("wait",)


def aligner(doc: dict[str, Any]) -> Callable[[float], float]:
    """Local perf_counter seconds of one rank -> rank 0's clock, from its measured offsets (start, end)."""
    clock = doc.get("clock") or {}
    o1, t1 = clock.get("offset", 0.0), clock.get("at", 0.0)
    o2, t2 = clock.get("offset_end", o1), clock.get("at_end", t1)
    if t2 <= t1:
        return lambda t: t - o1
    slope = (o2 - o1) / (t2 - t1)
    return lambda t: t - (o1 + slope * (t - t1))


def _rows(doc: dict[str, Any]) -> dict[int, list[Any]]:
    """{seq: record} of one rank's complete collectives in the window."""
    return {row[0]: row for step in doc.get("steps", []) for row in step.get("collectives", []) if row[9] > 0}


def comparable(c: dict[str, Any]) -> bool:
    """Whether a collective's arrivals can show a straggler (see ROOTED and UNEVEN)."""
    return c["op"] not in ROOTED and not any(word in (c["phase"] or "") for word in UNEVEN)


def collectives(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collectives every rank recorded whole, matched by sequence number, oldest first: seq, op, bucket,
    step, phase, bytes, dtype, and per rank (in the order of `docs`) its arrival and departure on rank 0's clock."""
    if not docs:
        return []
    maps = [_rows(d) for d in docs]
    aligns = [aligner(d) for d in docs]
    out = []
    for seq in sorted(set.intersection(*(set(m) for m in maps))):
        rows = [m[seq] for m in maps]
        if len({(r[1], r[2]) for r in rows}) > 1:  # not the same collective on every rank: not comparable
            continue
        first = rows[0]
        out.append({"seq": seq, "op": first[1], "bucket": first[2], "bytes": first[3], "dtype": first[4],
                    "phase": first[5], "step": first[6],
                    "arrive": [a(r[8]) for a, r in zip(aligns, rows)], "leave": [a(r[9]) for a, r in zip(aligns, rows)]})
    return out


def phase_times(doc: dict[str, Any]) -> dict[int, dict[str, float]]:
    """{step: {phase: seconds}} of one rank's recorded steps (a phase that ran several times, summed)."""
    out: dict[int, dict[str, float]] = {}
    for step in doc.get("steps", []):
        sums = out.setdefault(step["step"], {p: 0.0 for p in STEP_PHASES})
        for name, _ident, start, end, _args in step.get("spans", []):
            if name in sums:
                sums[name] += end - start
    return out


def _median_others(values: list[float], me: int) -> float:
    return statistics.median([v for r, v in enumerate(values) if r != me]) if len(values) > 1 else values[0]


def analyse(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `straggler` entry of summary.json (and of the report) for the ranks' timeline files `docs`, one per
    rank in rank order. Times in ms."""
    world = len(docs)
    colls = [c for c in collectives(docs) if comparable(c)]
    times = [phase_times(d) for d in docs]
    steps = sorted(set.intersection(*(set(t) for t in times))) if times else []
    made, last_n = [0.0] * world, [0] * world
    by_step: dict[int, list[float]] = {}  # per step, what each rank made the others wait
    made_phase = [{p: 0.0 for p in BLAMED} for _ in range(world)]
    skews = []
    for c in colls:
        arrive = c["arrive"]
        last = max(range(world), key=arrive.__getitem__)
        skews.append(arrive[last] - min(arrive))
        if world < 2:
            continue
        caused = _median_others([arrive[last] - t for t in arrive], last)
        made[last] += caused
        last_n[last] += 1
        by_step.setdefault(c["step"], [0.0] * world)[last] += caused
        if c["step"] in times[last]:
            behind = {p: times[last][c["step"]][p] - _median_others([t.get(c["step"], {}).get(p, 0.0) for t in times], last)
                      for p in BLAMED}
            total = sum(v for v in behind.values() if v > 0)
            for p, v in behind.items():
                if v > 0:
                    made_phase[last][p] += caused * v / total
    n = max(1, len(steps))
    # each rank's typical step: the median over the steps (the first step's start-up is no straggler's doing)
    mean = [{p: statistics.median(t[s][p] for s in steps) if steps else 0.0 for p in STEP_PHASES} for t in times]
    step_s = statistics.median(sum(m[p] for p in STEP_PHASES) for m in mean) if mean else 0.0
    out: dict[str, Any] = {
        "verdict": "no straggler", "rank": None, "phase": None, "steps": len(steps), "collectives": len(colls),
        "world_size": world, "step_ms": step_s * 1e3,
        "arrival_skew_ms": _quantiles(skews),
        "made_others_wait_ms_per_step": [v / n * 1e3 for v in made],
        "last_arrivals": last_n,
        "phase_ms": [{p: m[p] * 1e3 for p in STEP_PHASES} for m in mean],
        "made_others_wait_by_phase_ms_per_step": [{p: v / n * 1e3 for p, v in mp.items() if v > 0} for mp in made_phase],
    }
    if world < 2 or not colls or sum(made) <= 0:
        out["verdict"] = "no straggler" if world > 1 else "no straggler (one rank)"
        return out
    worst = max(range(world), key=made.__getitem__)
    per_step = made[worst] / n
    # in how many steps it made the others wait the most: a straggler does so step after step, noise does not
    first = sum(max(range(world), key=waits.__getitem__) == worst for waits in by_step.values()) / len(by_step)
    out.update(share=made[worst] / sum(made), most_waiting_steps=first)
    if first < 0.5 + 0.5 / world or per_step < max(MIN_EFFECT * step_s, MIN_WAIT_S):
        return out
    phase = max(BLAMED, key=lambda p: mean[worst][p] - _median_others([m[p] for m in mean], worst))
    mine, theirs = mean[worst][phase], _median_others([m[phase] for m in mean], worst)
    waited = f"the others waited {per_step * 1e3:.2f} ms per step for it"
    if mine - theirs < per_step / 4:  # no traced phase explains it: the time is between them
        out.update(rank=worst, verdict=f"rank {docs[worst]['rank']} is the straggler, in no traced phase (its time "
                                       f"between them); {waited}")
        return out
    pct = (mine - theirs) / theirs * 100 if theirs > 0 else None
    slower = (f"{pct:.0f} % slower than" if pct is not None and pct <= 1000 else
              f"{mine / theirs:.0f} times as long as" if pct is not None else "longer than")
    out.update(rank=worst, phase=phase, slower_pct=pct, verdict=(
        f"rank {docs[worst]['rank']} is the straggler: {phase} {slower} the median of the other ranks ({mine * 1e3:.2f} "
        f"ms against {theirs * 1e3:.2f} ms per step); {waited}"))
    return out


def _quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile and maximum of `values` (seconds), in ms; zeros when empty."""
    if not values:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered) * 1e3, "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "max": ordered[-1] * 1e3}
