"""Straggler attribution over the traced window: who arrived last at each collective, how long the others waited
for it, in which phase it lost that time, and one verdict. Pure functions of the ranks' timeline files.

Every rank's times are put on rank 0's clock first (`aligner`: the offsets measured at start and end,
interpolated). Then, for each collective every member of its communicator recorded in full (matched by the
communicator and its sequence number in it, which the flight recorder gives in the order of entry: a
data-parallel or a tensor-parallel group's collectives are compared among that group's ranks): each rank's
arrival, the last rank, and the time the others waited for it (the median of their waits). The wait is the
last rank's doing; it is split between the phases of that step in which the last rank was slower than the
median of the other ranks, in proportion to how much slower.

Only ranks that do the same work are compared: the ranks of one pipeline stage (`stage_of`; every rank is
stage 0 without a pipeline). The stages of a pipeline wait for each other by design (its bubble: the first
stage ends its step last, the last stage starts it last), so a collective that spans stages is compared
within each stage, and the point-to-point transfers and the waits for a neighbour stage ("pipeline wait")
are never blamed; the verdict of a pipelined run says so. Nor is a wait for a neighbour blamed through a
collective: with replicas (D > 1), the rank of a replica whose other stage is slow waits for it through the
pipeline and arrives as late at its own stage's gradient sum, as if it were slow itself. So a collective is
compared by each member's own arrival (`own_arrivals`): its arrival less the time it waited for a neighbour
stage since it left its previous collective, where the ranks were last in step. Time inside tensor-parallel
sums is taken out of forward and backward ("tensor-parallel sums"): there every rank of the group waits for
the slowest.

Phase times are each rank's median over the steps. A rank is named the straggler when it made the others
wait the longest in most steps (at least 1/2 + 1/(2W) of them: 3/4 with two ranks, 5/8 with four, more than
half with many; on a busy node every rank is late now and then, a straggler is late step after step) and
that waiting is not noise (at least `MIN_EFFECT` of the median step, and `MIN_WAIT_S`); the phase named is
the one where it is furthest behind the median of the other ranks of its stage, if that explains a quarter
of the waiting at least; when none does and the rank is at least `EVERY_PHASE` slower in each of forward,
backward and the optimizer step, the verdict says it is slower in every phase (a core shared or slower), else
that its time is in no traced phase. Only collectives whose arrivals can show a straggler count (`comparable`: not a
root's gathers and broadcasts, not validation, checkpoint writes or start-up, where the ranks' shares of
the work differ by design).
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any, Callable

from .lineup import records

MIN_EFFECT = 0.10  # the straggler's waiting per step, as a fraction of the median step, below which it is noise
MIN_WAIT_S = 0.001  # and in seconds: a rank's own bookkeeping (rank 0 logs, checks the checkpoint policy) is less
# when no phase explains the waiting alone: a rank this much slower (or more) in each compute phase is slow at
# everything (a rank sharing its core with another process was 43-57 % slower in each, and lost more between them)
EVERY_PHASE = 0.10
COMPUTE = ("forward", "backward", "optimizer")
# collectives whose arrivals say nothing about a straggler: a root's own work comes first by design (gathers and
# broadcasts of a checkpoint's completion), or each rank's share of the work differs (validation, start-up)
ROOTED = ("gather", "bcast")
UNEVEN = ("checkpoint write", "validation", "start-up", "summary", "clock")
# the phases of a step that can make a rank late (the exposed wait for the gradients is a rank's waiting, not its
# work; so are a pipeline stage's waits for its neighbours and the time inside tensor-parallel sums)
BLAMED = ("data wait", "zero", "forward", "backward", "optimizer", "validation", "checkpoint stall")
TP_SUMS = "tensor-parallel sums"
NEIGHBOUR_WAIT = "pipeline wait"  # a pipeline stage waiting for its neighbour (parallel.pipeline's span)
STEP_PHASES = BLAMED + ("wait", NEIGHBOUR_WAIT, TP_SUMS)
PIPELINE = "pipeline"  # the name of a pipeline's communicator (parallel.groups), by which a rank's stage is known
# the tensor-parallel sums (parallel.tensor's labels) inside a forward, and inside a backward
SUMS = {"forward sum": "forward", "loss max": "forward", "loss sums": "forward", "backward sum": "backward"}
_OP, _START, _END = 1, 8, 9  # of a record's fields (flight.FIELDS)


def aligner(doc: dict[str, Any]) -> Callable[[float], float]:
    """Local perf_counter seconds of one rank -> rank 0's clock, from its measured offsets (start, end)."""
    clock = doc.get("clock") or {}
    o1, t1 = clock.get("offset", 0.0), clock.get("at", 0.0)
    o2, t2 = clock.get("offset_end", o1), clock.get("at_end", t1)
    if t2 <= t1:
        return lambda t: t - o1
    slope = (o2 - o1) / (t2 - t1)
    return lambda t: t - (o1 + slope * (t - t1))


def stage_of(doc: dict[str, Any]) -> int:
    """A rank's pipeline stage: its place in the newest communicator named "pipeline" it holds (0: none)."""
    for group in reversed(doc.get("groups") or []):
        ranks = group.get("ranks") or []
        if group.get("name") == PIPELINE and doc["rank"] in ranks:
            return ranks.index(doc["rank"])
    return 0


def comparable(c: dict[str, Any]) -> bool:
    """Whether a collective's arrivals can show a straggler (see ROOTED and UNEVEN)."""
    return c["op"] not in ROOTED and not any(word in (c["phase"] or "") for word in UNEVEN)


def collectives(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collectives every member of their communicator recorded whole, matched by (communicator, its sequence
    number), oldest first: seq (the communicator's), group (its name), ranks (its members), op, bucket, step,
    phase, bytes, dtype, micro, and per member (in the order of `ranks`) its arrival and departure on rank 0's
    clock. Point-to-point transfers are not collectives: they are left out."""
    if not docs:
        return []
    pos = {d["rank"]: i for i, d in enumerate(docs)}
    maps = []
    for d in docs:
        rows = [row for step in d.get("steps", []) for row in step.get("collectives", [])]
        maps.append({(r["group"], r["gseq"]): r for r in records(d, len(docs), rows)[0] if r["peer"] < 0 and r["end"] > 0})
    aligns = [aligner(d) for d in docs]
    out = []
    for key in set().union(*maps):
        group = key[0]
        if any(m not in pos or key not in maps[pos[m]] for m in group[1]):
            continue  # a member outside the timeline (another run's), or that did not record it whole
        rows = [maps[pos[m]][key] for m in group[1]]
        if len({(r["op"], r["bucket"]) for r in rows}) > 1:  # not the same collective on every member
            continue
        first = rows[0]
        out.append({"seq": key[1], "group": group[0], "ranks": list(group[1]), "op": first["op"],
                    "bucket": first["bucket"], "bytes": first["bytes"], "dtype": first["dtype"],
                    "phase": first["phase"], "step": first["step"], "micro": first["micro"],
                    "arrive": [aligns[pos[m]](r["start"]) for m, r in zip(group[1], rows)],
                    "leave": [aligns[pos[m]](r["end"]) for m, r in zip(group[1], rows)]})
    return sorted(out, key=lambda c: min(c["arrive"]))


def neighbour_waits(doc: dict[str, Any]) -> list[tuple[float, float]]:
    """[(start, end)] of one rank's waits for a neighbour pipeline stage, on rank 0's clock, oldest first."""
    align = aligner(doc)
    return sorted((align(start), align(end)) for step in doc.get("steps", [])
                  for name, _ident, start, end, _args in step.get("spans", []) if name == NEIGHBOUR_WAIT)


def own_arrivals(c: dict[str, Any], pos: dict[int, int], waits: list[list[tuple[float, float]]],
                 leaves: list[list[float]]) -> list[float]:
    """Each member's arrival at collective `c` less the time it waited for a neighbour stage since it left its
    previous collective (`leaves`: each rank's departures, sorted), where the members were last in step: when it
    would have arrived had its neighbours not kept it waiting."""
    out = []
    for rank, arrive in zip(c["ranks"], c["arrive"]):
        i = pos[rank]
        before = bisect.bisect_left(leaves[i], arrive)
        since = leaves[i][before - 1] if before else float("-inf")
        # one thread's waits, one after another: sorted by start and by end alike
        lo = bisect.bisect_right(waits[i], (since, since))
        lo = lo - 1 if lo and waits[i][lo - 1][1] > since else lo
        hi = bisect.bisect_left(waits[i], (arrive, arrive))
        out.append(arrive - sum(max(0.0, min(end, arrive) - max(start, since)) for start, end in waits[i][lo:hi]))
    return out


def phase_times(doc: dict[str, Any]) -> dict[int, dict[str, float]]:
    """{step: {phase: seconds}} of one rank's recorded steps (a phase that ran several times, summed; the time
    inside tensor-parallel sums taken out of forward and backward)."""
    out: dict[int, dict[str, float]] = {}
    for step in doc.get("steps", []):
        sums = out.setdefault(step["step"], {p: 0.0 for p in STEP_PHASES})
        for name, _ident, start, end, _args in step.get("spans", []):
            if name in sums:
                sums[name] += end - start
        for row in step.get("collectives", []):
            inside = SUMS.get(row[_OP])
            if inside is not None and row[_END] > 0:
                sums[inside] -= row[_END] - row[_START]
                sums[TP_SUMS] += row[_END] - row[_START]
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _attribute(c: dict[str, Any], pos: dict[int, int], stages: list[int], times: list[dict[int, dict[str, float]]],
               own: list[float], acc: dict[str, Any]) -> None:
    """Add collective `c` to the tallies `acc`, compared within each pipeline stage among its members by their
    own arrivals `own` (see `own_arrivals`)."""
    parts: dict[int, list[int]] = {}
    for k, rank in enumerate(c["ranks"]):
        parts.setdefault(stages[pos[rank]], []).append(k)
    for ks in parts.values():
        if len(ks) < 2:  # a stage alone in this collective: nobody does the same work beside it
            continue
        arrive = [own[k] for k in ks]
        who = [pos[c["ranks"][k]] for k in ks]
        j = max(range(len(ks)), key=arrive.__getitem__)
        last, peers = who[j], who[:j] + who[j + 1:]
        acc["skews"].append(max(c["arrive"][k] for k in ks) - min(c["arrive"][k] for k in ks))
        caused = _median([arrive[j] - t for i, t in enumerate(arrive) if i != j])
        acc["made"][last] += caused
        acc["last_n"][last] += 1
        acc["by_step"].setdefault(c["step"], [0.0] * len(stages))[last] += caused
        mine = times[last].get(c["step"])
        if mine is None:
            continue
        behind = {p: mine[p] - _median([times[i].get(c["step"], {}).get(p, 0.0) for i in peers]) for p in BLAMED}
        total = sum(v for v in behind.values() if v > 0)
        for p, v in behind.items():
            if v > 0:
                acc["made_phase"][last][p] += caused * v / total


def analyse(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `straggler` entry of summary.json (and of the report) for the ranks' timeline files `docs`, one per
    rank in rank order. Times in ms."""
    world = len(docs)
    matched = collectives(docs)
    colls = [c for c in matched if comparable(c)]
    times = [phase_times(d) for d in docs]
    stages = [stage_of(d) for d in docs]
    pos = {d["rank"]: i for i, d in enumerate(docs)}
    steps = sorted(set.intersection(*(set(t) for t in times))) if times else []
    acc: dict[str, Any] = {"made": [0.0] * world, "last_n": [0] * world, "by_step": {}, "skews": [],
                           "made_phase": [{p: 0.0 for p in BLAMED} for _ in range(world)]}
    waits = [neighbour_waits(d) for d in docs]
    leaves: list[list[float]] = [[] for _ in docs]
    for c in matched:
        for rank, t in zip(c["ranks"], c["leave"]):
            leaves[pos[rank]].append(t)
    for row in leaves:
        row.sort()
    for c in colls:
        _attribute(c, pos, stages, times, own_arrivals(c, pos, waits, leaves), acc)
    made, by_step = acc["made"], acc["by_step"]
    n = max(1, len(steps))
    # each rank's typical step: the median over the steps (the first step's start-up is no straggler's doing)
    mean = [{p: statistics.median(t[s][p] for s in steps) if steps else 0.0 for p in STEP_PHASES} for t in times]
    step_s = statistics.median(sum(m[p] for p in STEP_PHASES) for m in mean) if mean else 0.0
    piped = max(stages, default=0) > 0
    note = (" (a pipeline: ranks compared with the others of their stage; the stages' waits for each other, its "
            "bubble, not counted)") if piped else ""
    out: dict[str, Any] = {
        "verdict": "no straggler" + note, "rank": None, "phase": None, "steps": len(steps), "collectives": len(colls),
        "world_size": world, "step_ms": step_s * 1e3, "stages": max(stages, default=0) + 1,
        "arrival_skew_ms": _quantiles(acc["skews"]),
        "made_others_wait_ms_per_step": [v / n * 1e3 for v in made],
        "last_arrivals": acc["last_n"],
        "phase_ms": [{p: m[p] * 1e3 for p in STEP_PHASES} for m in mean],
        "made_others_wait_by_phase_ms_per_step": [{p: v / n * 1e3 for p, v in mp.items() if v > 0}
                                                  for mp in acc["made_phase"]],
    }
    if world < 2 or sum(made) <= 0:
        out["verdict"] = "no straggler" + (note if world > 1 else " (one rank)")
        return out
    worst = max(range(world), key=made.__getitem__)
    per_step = made[worst] / n
    # in how many steps it made the others wait the most: a straggler does so step after step, noise does not
    first = sum(max(range(world), key=waits.__getitem__) == worst for waits in by_step.values()) / len(by_step)
    out.update(share=made[worst] / sum(made), most_waiting_steps=first)
    if first < 0.5 + 0.5 / world or per_step < max(MIN_EFFECT * step_s, MIN_WAIT_S):
        return out
    peers = [i for i in range(world) if i != worst and stages[i] == stages[worst]]
    theirs_of = {p: _median([mean[i][p] for i in peers]) for p in BLAMED}
    phase = max(BLAMED, key=lambda p: mean[worst][p] - theirs_of[p])
    mine, theirs = mean[worst][phase], theirs_of[phase]
    waited = f"the others waited {per_step * 1e3:.2f} ms per step for it"
    others = "the other ranks of its stage" if piped else "the other ranks"
    if mine - theirs < per_step / 4:  # no traced phase explains it alone
        slower = {p: (mean[worst][p] - theirs_of[p]) / theirs_of[p] for p in COMPUTE if theirs_of[p] > 0}
        if len(slower) == len(COMPUTE) and min(slower.values()) >= EVERY_PHASE:
            # a rank slow at everything, a little in each phase and between them: its core (shared or slower)
            each = ", ".join(f"{p} +{v * 100:.0f} %" for p, v in slower.items())
            out.update(rank=worst, phase="every phase", verdict=(
                f"rank {docs[worst]['rank']} is the straggler, slower in every phase ({each} against the median of "
                f"{others}) and between them, as a rank whose core is shared with other work or slower is; {waited}"
                f"{note}"))
            return out
        out.update(rank=worst, verdict=f"rank {docs[worst]['rank']} is the straggler, in no traced phase (its time "
                                       f"between them); {waited}{note}")
        return out
    pct = (mine - theirs) / theirs * 100 if theirs > 0 else None
    slower = (f"{pct:.0f} % slower than" if pct is not None and pct <= 1000 else
              f"{mine / theirs:.0f} times as long as" if pct is not None else "longer than")
    out.update(rank=worst, phase=phase, slower_pct=pct, verdict=(
        f"rank {docs[worst]['rank']} is the straggler: {phase} {slower} the median of {others} ({mine * 1e3:.2f} "
        f"ms against {theirs * 1e3:.2f} ms per step); {waited}{note}"))
    return out


def _quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile and maximum of `values` (seconds), in ms; zeros when empty."""
    if not values:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered) * 1e3, "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "max": ordered[-1] * 1e3}
