"""The flight recorder and the timeline of runs split by --tp/--pp, without MPI: records numbered per communicator
and per point-to-point channel, the line-up of a stuck pipeline and of a tensor-parallel group on synthetic
dumps, the straggler compared within a pipeline stage, and the Chrome trace of a pipeline."""

from __future__ import annotations

import json
import random

from hpctrain.trace.chrome import chrome_trace
from hpctrain.trace.flight import FIELDS, FlightRecorder
from hpctrain.trace.lineup import line_up
from hpctrain.trace.straggler import analyse, collectives, phase_times, stage_of

DATA, PIPE = "data-parallel group", "pipeline"


def test_each_communicator_and_each_channel_is_numbered_on_its_own(tmp_path) -> None:
    rec = FlightRecorder(capacity=16)
    data, tensor = rec.group(DATA, (0, 2)), rec.group("tensor-parallel group", (0, 1))
    rec.micro = 3
    for i in range(3):
        rec.end(rec.begin("forward sum", group=tensor, micro=rec.micro))
    rec.end(rec.begin("allreduce", 0, "float32", group=data))
    sent = [rec.post("send activations", 2, "float32", 64, data, micro=m) for m in range(2)]
    got = rec.post("recv activation gradients", 2, "float32", 64, data, micro=0)
    rec.blocked = (got,)
    rows = [dict(zip(FIELDS, r)) for r in rec.rows()]
    assert [(r["op"], r["group"], r["gseq"]) for r in rows[:4]] == [("forward sum", tensor, 0), ("forward sum", tensor, 1),
                                                                    ("forward sum", tensor, 2), ("allreduce", data, 0)]
    assert rows[0]["micro"] == 3 and rows[3]["micro"] == -1 and rows[3]["peer"] == -1
    assert [(r["gseq"], r["peer"], r["micro"]) for r in rows[4:]] == [(0, 2, 0), (1, 2, 1), (0, 2, 0)]
    assert all(r["end"] == 0.0 for r in rows[4:])  # posted, not yet seen complete
    rec.end(sent[0])
    rec.configure(0, tmp_path / "rank-0000.flight.json", world=4)
    doc = json.loads(rec.dump("a test").read_text())
    assert doc["groups"][data] == {"name": DATA, "ranks": [0, 2], "entered": 1} and doc["groups"][tensor]["entered"] == 3
    assert sorted(map(tuple, doc["channels"])) == [(data, 2, "recv activation gradients", 1),
                                                   (data, 2, "send activations", 2)]
    assert doc["blocked"] == [got] and doc["fields"] == list(FIELDS)


# -- synthetic flight dumps ----------------------------------------------------------------------------------


def row(seq: int, op: str, group: int, gseq: int, *, step: int = 2, bucket: int = -1, peer: int = -1, micro: int = -1,
        ended: bool = True, phase: str | None = None) -> list:
    return [seq, op, bucket, 4096, "float32", phase, step, 1.0, 1.0, 2.0 if ended else 0.0, 7, group, gseq, peer, micro]


def pipeline_dump(rank: int, steps: list[list[tuple]], blocked_last: bool = False, phase: str | None = None) -> dict:
    """Rank `rank` of a (2, 1, 2) layout (rank = stage x 2 + replica) that recorded `steps`: per step, tuples
    (op, kind, gseq, extra) with kind "world", "data" or a transfer's peer rank; the last transfer of the last
    step is the one it is blocked on when `blocked_last`."""
    stage, d = divmod(rank, 2)
    groups = [{"name": "world", "ranks": None}, {"name": "world", "ranks": [0, 1, 2, 3]},
              {"name": DATA, "ranks": [2 * stage, 2 * stage + 1]}, {"name": PIPE, "ranks": [d, 2 + d]}]
    rows, channels, entered = [], {}, {1: 0, 2: 0}
    for step, ops in enumerate(steps, start=1):
        for op, kind, gseq, extra in ops:
            if isinstance(kind, int):  # a transfer with rank `kind`
                rows.append(row(len(rows), op, 3, gseq, step=step, peer=kind, **extra))
                channels[(3, kind, op)] = max(channels.get((3, kind, op), 0), gseq + 1)
            else:
                gid = {"world": 1, "data": 2}[kind]
                rows.append(row(len(rows), op, gid, gseq, step=step, **extra))
                entered[gid] = max(entered[gid], gseq + 1)
    for gid, n in entered.items():
        groups[gid]["entered"] = n
    return {"rank": rank, "world": 4, "reason": "watchdog", "time": 1000.0, "entered": len(rows), "fields": list(FIELDS),
            "records": rows, "groups": groups, "channels": [[*k, n] for k, n in channels.items()],
            "phase": phase, "step": len(steps), "blocked": [len(rows) - 1] if blocked_last else []}


def stuck_pipeline() -> dict[int, dict]:
    """Rank 0 (stage 0 of replica 0) stops in its forward of micro-batch 0 at step 2: rank 2 (its stage 1) waits
    for those activations, rank 1 and rank 3 (replica 1) finish their schedule and wait in the data-parallel
    gradient sum for ranks 0 and 2."""
    start = [("allgather", "world", s, {}) for s in range(3)]
    first = {0: [("send activations", 2, 0, {"micro": 0}), ("recv activation gradients", 2, 0, {"micro": 0})],
             1: [("send activations", 3, 0, {"micro": 0}), ("recv activation gradients", 3, 0, {"micro": 0})],
             2: [("recv activations", 0, 0, {"micro": 0}), ("send activation gradients", 0, 0, {"micro": 0})],
             3: [("recv activations", 1, 0, {"micro": 0}), ("send activation gradients", 1, 0, {"micro": 0})]}
    end = [("allreduce", "data", 0, {"bucket": 0}), ("allreduce", "world", 3, {"phase": "stop/checkpoint agreement"})]
    stuck = {"ended": False, "bucket": 0, "phase": "gradient allreduce"}
    second = {0: [("recv activation gradients", 2, 1, {"micro": 0, "ended": False})],
              1: first[1][:1] + [("recv activation gradients", 3, 1, {"micro": 0}), ("allreduce", "data", 1, stuck)],
              2: [("recv activations", 0, 1, {"micro": 0, "ended": False})],
              3: [("recv activations", 1, 1, {"micro": 0}), ("send activation gradients", 1, 1, {"micro": 0}),
                  ("allreduce", "data", 1, stuck)]}
    second[1][0] = ("send activations", 3, 1, {"micro": 0})
    dumps = {r: pipeline_dump(r, [start + first[r] + end, second[r]], blocked_last=r == 2) for r in range(4)}
    dumps[0]["phase"] = "pipeline stage 0 computing the forward of micro-batch 0"
    return dumps


def test_the_line_up_names_the_transfer_a_stage_waits_for_and_the_rank_that_never_sent_it() -> None:
    found = line_up(4, stuck_pipeline(), {})
    assert found["culprits"] == [0]
    [stuck] = found["transfers"]
    assert (stuck["rank"], stuck["peer"], stuck["micro"], stuck["step"], stuck["never_posted"]) == (2, 0, 0, 2, True)
    assert found["text"].startswith(
        "the job waits for rank 0: stage 1 (rank 2) waits for the activations of micro-batch 0 at step 2 from stage 0 "
        "(rank 0), which never sent them (rank 0 was in pipeline stage 0 computing the forward of micro-batch 0 at "
        "step 2)"), found["text"]
    # each data-parallel group lined up by its own numbering (the ranks' records are numbered differently overall)
    groups = {tuple(g["ranks"]): g for g in found["groups"]}
    assert set(groups) == {(0, 1), (2, 3)} and all(g["seq"] == 1 and g["collective"] == "allreduce" for g in groups.values())
    assert groups[(0, 1)]["waiting"] == [1] and groups[(0, 1)]["missing"] == [0]
    assert groups[(2, 3)]["waiting"] == [3] and groups[(2, 3)]["missing"] == [2]
    assert ("ranks 0, 1 of the data-parallel group diverge at collective #1 allreduce of bucket 0 (float32, 0.00 MB) "
            "at step 2 (gradient allreduce): rank 1 entered it and was still inside; rank 0 never arrived") in found["text"]
    # the world's collectives all finished: not a finding (the old line-up by one numbering per process said the
    # ranks disagreed at the first transfer)
    assert "the ranks" not in found["text"].replace("the ranks diverge", "") and "disagree" not in found["text"]


def test_a_send_whose_receive_was_never_posted_and_a_peer_without_a_record() -> None:
    dumps = stuck_pipeline()
    dumps[2]["records"][-1][1] = "send activation gradients"  # rank 2 blocked sending to a stage that never receives
    dumps[2]["channels"].append([3, 0, "send activation gradients", 2])
    dumps[0]["records"].pop()  # rank 0 stopped before it posted that receive
    dumps[0]["channels"] = [[3, 2, "send activations", 1], [3, 2, "recv activation gradients", 1]]
    found = line_up(4, dumps, {})
    assert found["culprits"] == [0]
    assert "stage 1 (rank 2) waits for stage 0 (rank 0) to take the activation gradients of micro-batch 0 at step 2, " \
           "which never posted its receive" in found["text"]
    del dumps[0]
    found = line_up(4, dumps, {})
    assert found["no_record"] == [0] and "which left no flight record" in found["text"]


def test_a_tensor_parallel_group_is_lined_up_by_its_own_numbering() -> None:
    """Two tensor-parallel groups (0, 1) and (2, 3); ranks 0 and 1 also sum over a third group, so the ranks'
    records are numbered differently overall. Rank 3 never enters the third sum of micro-batch 1."""
    def dump(rank: int) -> dict:
        tp = (0, 1) if rank < 2 else (2, 3)
        groups = [{"name": "world", "ranks": None, "entered": 0}, {"name": "world", "ranks": [0, 1, 2, 3], "entered": 2},
                  {"name": "tensor-parallel group", "ranks": list(tp)}, {"name": "first and last stage", "ranks": [0, 1]}]
        rows = [row(0, "allgather", 1, 0, step=0), row(1, "allreduce", 1, 1, step=1)]
        if rank < 2:
            rows += [row(len(rows) + i, "tied gradient sum", 3, i, step=1) for i in range(4)]
        sums = [("forward sum", m) for m in range(2) for _ in range(4)]
        if rank == 3:
            sums = sums[:6]
        for k, (op, m) in enumerate(sums):
            hang = rank == 2 and k == 6
            rows.append(row(len(rows), op, 2, k, micro=m, ended=not hang,
                            phase=f"pipeline stage 0 computing the forward of micro-batch {m}"))
        groups[2]["entered"] = len(sums)
        groups[3]["entered"] = 4 if rank < 2 else 0
        return {"rank": rank, "world": 4, "reason": "watchdog", "time": 1000.0, "entered": len(rows),
                "fields": list(FIELDS), "records": rows, "groups": groups, "channels": [], "phase": None, "blocked": []}

    found = line_up(4, {r: dump(r) for r in range(4)}, {})
    [diverged] = found["groups"]
    assert diverged["ranks"] == [2, 3] and diverged["seq"] == 6 and diverged["missing"] == [3] and diverged["waiting"] == [2]
    assert found["text"].startswith("ranks 2, 3 of the tensor-parallel group diverge at collective #6 forward sum of "
                                    "micro-batch 1 (float32, 0.00 MB) at step 2 (pipeline stage 0 computing the forward of "
                                    "micro-batch 1): rank 2 entered it and was still inside; rank 3 never arrived"), found["text"]
    assert found["culprits"] == [3]


# -- synthetic timelines of a pipeline ----------------------------------------------------------------------


def pipeline_docs(data: int, steps: int, *, slow: int | None = None, extra: float = 0.0, jitter: float = 0.001,
                  seed: int = 0) -> list[dict]:
    """A (data, 1, 2) pipeline (rank = stage x data + replica), two micro-batches a step: each stage's forwards and
    backwards, its wait for the other stage (stage 1 waits at the start, stage 0 in the middle: the bubble), the
    data-parallel gradient sum of each stage (when data > 1), and a world agreement at which stage 0 always
    arrives last (it ends the schedule); the transfers between the stages. Rank `slow`'s backward takes `extra`
    more seconds."""
    rng = random.Random(seed)
    world = 2 * data
    docs = []
    for rank in range(world):
        stage, d = divmod(rank, data)
        groups = [{"name": "world", "ranks": None}, {"name": "world", "ranks": list(range(world))},
                  {"name": DATA, "ranks": [stage * data + k for k in range(data)]}, {"name": PIPE, "ranks": [d, data + d]}]
        docs.append({"rank": rank, "host": "h", "main": 1, "threads": {"1": "MainThread"}, "window": f"1:{steps}",
                     "clock": {"offset": 0.0, "error": 1e-6, "at": 0.0}, "startup": [], "steps": [],
                     "fields": list(FIELDS), "groups": groups})
    t0, seq = 100.0, [0] * world
    for step in range(1, steps + 1):
        ends, rows, spans = [], [[] for _ in range(world)], [[] for _ in range(world)]
        for rank in range(world):
            stage, d = divmod(rank, data)
            t = t0 + (0.0 if stage == 0 else 0.005)  # stage 1 waits for stage 0's first forward
            if stage == 1:
                spans[rank].append(["pipeline wait", 1, t0, t, {"micro": 0}])
            for m in range(2):
                f, b = 0.005 + rng.uniform(0, jitter), 0.010 + rng.uniform(0, jitter) + (extra if rank == slow else 0.0)
                spans[rank].append(["forward", 1, t, t + f, {"micro": m}])
                peer = data + d if stage == 0 else d
                op = "send activations" if stage == 0 else "recv activations"
                rows[rank].append([seq[rank], op, -1, 64, "float32", None, step, t + f, t + f, t + f + 0.001, 1, 3,
                                   2 * (step - 1) + m, peer, m])
                seq[rank] += 1
                spans[rank].append(["backward", 1, t + f, t + f + b, {"micro": m}])
                t += f + b
            t += 0.02 if stage == 0 else 0.0  # the first stage ends the schedule last
            ends.append(t)
        for stage in range(2):
            members = range(stage * data, stage * data + data)
            leave = max(ends[r] for r in members) + 0.0005
            for r in members if data > 1 else ():
                rows[r].append([seq[r], "allreduce", 0, 4096, "float32", "gradient allreduce", step, ends[r], ends[r],
                                leave, 1, 2, step - 1, -1, -1])
                seq[r] += 1
                spans[r].append(["wait", 1, ends[r], leave, None])
                ends[r] = leave
        leave = max(ends) + 0.0005
        for r in range(world):
            rows[r].append([seq[r], "allreduce", -1, 32, "float64", "stop/checkpoint agreement", step, ends[r], ends[r],
                            leave, 1, 1, step - 1, -1, -1])
            seq[r] += 1
            docs[r]["steps"].append({"step": step, "spans": spans[r] + [["optimizer", 1, leave, leave + 0.002, None]],
                                     "collectives": rows[r]})
        t0 = leave + 0.003
    return docs


def test_a_pipelines_bubble_is_no_straggler() -> None:
    """Stage 0 arrives last at every world collective by design: compared within stages, nobody is late."""
    for data in (1, 2):
        docs = pipeline_docs(data, 20, seed=data)
        assert [stage_of(d) for d in docs] == [0] * data + [1] * data
        found = analyse(docs)
        assert found["rank"] is None and found["stages"] == 2, found
        assert found["verdict"] == ("no straggler (a pipeline: ranks compared with the others of their stage; the "
                                    "stages' waits for each other, its bubble, not counted)")


def test_a_straggler_in_a_pipeline_is_named_against_its_stage() -> None:
    found = analyse(pipeline_docs(2, 20, slow=3, extra=0.004))
    assert found["rank"] == 3 and found["phase"] == "backward", found["verdict"]
    assert "backward" in found["verdict"] and "the median of the other ranks of its stage" in found["verdict"]
    assert found["made_others_wait_ms_per_step"][2] == 0.0  # rank 2 waited for rank 3: it made nobody wait
    # the transfers are not collectives, and each data-parallel group's sums are compared among its own ranks
    colls = collectives(pipeline_docs(2, 3))
    assert {(c["group"], tuple(c["ranks"])) for c in colls} == {("world", (0, 1, 2, 3)), (DATA, (0, 1)), (DATA, (2, 3))}


def test_the_time_inside_tensor_parallel_sums_is_its_own_phase() -> None:
    doc = {"rank": 0, "steps": [{"step": 1, "spans": [["forward", 1, 0.0, 0.010, None], ["backward", 1, 0.010, 0.030, None]],
                                 "collectives": [row(0, "forward sum", 2, 0)[:8] + [0.002, 0.005, 1, 2, 0, -1, 0],
                                                 row(1, "backward sum", 2, 1)[:8] + [0.020, 0.021, 1, 2, 1, -1, 0]]}]}
    times = phase_times(doc)[1]
    assert round(times["forward"], 6) == 0.007 and round(times["backward"], 6) == 0.019
    assert round(times["tensor-parallel sums"], 6) == 0.004


def test_the_chrome_trace_of_a_pipeline_shows_micro_batches_transfers_and_groups() -> None:
    docs = pipeline_docs(2, 3)
    trace = json.loads(json.dumps(chrome_trace(docs, analyse(docs))))
    events = trace["traceEvents"]
    forwards = [e for e in events if e["ph"] == "X" and e["name"] == "forward"]
    assert sorted({(e["pid"], e["args"]["micro"]) for e in forwards}) == [(r, m) for r in range(4) for m in range(2)]
    assert any(e["ph"] == "X" and e["name"] == "pipeline wait" for e in events)
    begins = [e for e in events if e["ph"] == "b" and e["cat"] == "point-to-point"]
    assert len(begins) == 4 * 2 * 3 and len([e for e in events if e["ph"] == "e"]) == len(begins)
    assert {e["name"] for e in begins if e["pid"] == 0} == {f"send activations of micro-batch {m} to rank 2" for m in range(2)}
    arrows = [e for e in events if e.get("cat") == "transfer"]
    assert {(s["pid"], f["pid"]) for s, f in zip(arrows[::2], arrows[1::2])} == {(0, 2), (1, 3)}
    sums = [e for e in events if e["ph"] == "X" and e["cat"] == "collective" and e["args"].get("group") == DATA]
    assert sums and all(e["name"] == f"allreduce bucket 0 ({DATA})" for e in sums)
    assert {tuple(e["args"]["ranks"]) for e in sums} == {(0, 1), (2, 3)}
