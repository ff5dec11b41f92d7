"""The timeline and the flight recorder without MPI: the --trace window, the ring's bound, the span recorder, and
the pure analysis (straggler attribution, the Chrome trace, the line-up of flight records) on synthetic records."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest

from hpctrain.base.config import TrainConfig
from hpctrain.base.errors import ConfigError
from hpctrain.base.window import MAX_STEPS, parse_window
from hpctrain.control.tracing import hang_point, straggler_delay
from hpctrain.trace.chrome import brief, chrome_trace, clock_summary
from hpctrain.trace.flight import FIELDS, FlightRecorder
from hpctrain.trace.lineup import line_up
from hpctrain.trace.spans import Tracer
from hpctrain.trace.straggler import aligner, analyse, collectives

# -- the window and the test hooks -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec, steps", [("3:5", [3, 4, 5]), ("last:4", list(range(1, 11))), ("every:3", [3, 6, 9])])
def test_a_window_selects_its_steps(spec: str, steps: list[int]) -> None:
    window = parse_window(spec)
    assert [s for s in range(1, 11) if window.selects(s)] == steps and str(window) == spec


@pytest.mark.parametrize("spec", ["", "5", "0:3", "7:3", f"1:{MAX_STEPS + 1}", "last:0", f"last:{MAX_STEPS + 1}",
                                  "every:0", "every:x", "100-120", "sample:3"])
def test_a_bad_window_is_refused_in_one_line_that_shows_the_forms(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig.flat(data=".", run_dir=".", trace=spec)
    text = str(err.value)
    assert f"--trace {spec!r}" in text and "A:B" in text and "last:N" in text and "every:N" in text and "\n" not in text


def test_the_test_hooks_read_their_rank_only() -> None:
    assert straggler_delay("2:0.05", 2) == 0.05 and straggler_delay("2:0.05", 1) == 0.0 and straggler_delay(None, 0) == 0
    assert hang_point("1:5:0", 1) == (5, 0) and hang_point("1:5:0", 0) is None
    for bad in ("1", "a:b"):
        with pytest.raises(ConfigError, match="a test hook"):
            straggler_delay(bad, 0)
        with pytest.raises(ConfigError, match="RANK:STEP:BUCKET"):
            hang_point(bad, 0)


# -- the flight recorder ---------------------------------------------------------------------------------------


def test_the_ring_keeps_the_last_capacity_records_and_their_fields(tmp_path) -> None:
    rec = FlightRecorder(capacity=8)
    rec.phase, rec.step = "gradient allreduce", 3
    for i in range(20):
        rec.handoff(i % 3)
        seq = rec.begin("allreduce", i % 3, "float32", counter=100 * i)
        if i != 19:  # the last one never ends: as in a hang
            rec.end(seq, counter=100 * i + 64)
    rows = rec.rows()
    assert [r[0] for r in rows] == list(range(12, 20)) and rec.entered == 20
    row = dict(zip(FIELDS, rows[0]))
    assert row["op"] == "allreduce" and row["bytes"] == 64 and row["phase"] == "gradient allreduce" and row["step"] == 3
    assert row["enqueue"] <= row["start"] <= row["end"] and row["thread"] == threading.get_ident()
    assert rows[-1][FIELDS.index("end")] == 0.0  # unfinished
    assert rec.rows(first=18) == rows[-2:]
    rec.configure(2, tmp_path / "rank-0002.flight.json", world=4)
    doc = json.loads(rec.dump("a test").read_text())
    assert doc["rank"] == 2 and doc["world"] == 4 and doc["reason"] == "a test" and len(doc["records"]) == 8
    with pytest.raises(ValueError):
        FlightRecorder(capacity=6)


def test_a_record_written_over_is_not_ended_twice() -> None:
    rec = FlightRecorder(capacity=2)
    first = rec.begin("barrier")
    for _ in range(2):
        rec.begin("barrier")
    rec.end(first)  # its row belongs to a later collective now: left alone
    assert all(r[FIELDS.index("end")] == 0.0 for r in rec.rows())


# -- the span recorder -----------------------------------------------------------------------------------------


def test_the_tracer_keeps_a_bounded_window_of_steps() -> None:
    tracer = Tracer()
    tracer.start(parse_window("last:3"), rank=0)
    for step in range(1, 11):
        tracer.begin_step(step)
        tracer.span("forward", step, step + 0.5)
    doc = tracer.snapshot()
    assert [s["step"] for s in doc["steps"]] == [8, 9, 10] and doc["window"] == "last:3"
    assert all(len(s["spans"]) == 1 and s["collectives"] == [] for s in doc["steps"])
    tracer.start(parse_window("4:5"), rank=1)
    for step in range(1, 11):
        tracer.begin_step(step)
        tracer.span("forward", step, step + 0.5)
    assert [s["step"] for s in tracer.snapshot()["steps"]] == [4, 5]
    tracer.start(None)
    tracer.span("forward", 0, 1)
    assert tracer.snapshot()["steps"] == [] and not tracer.active


# -- synthetic timelines: W ranks, S steps, one collective per step ----------------------------------------------


def make_docs(world: int, steps: int, *, slow: int | None = None, phase: str = "backward", extra: float = 0.02,
              jitter: float = 0.002, seed: int = 0, offsets: list[float] | None = None, noisy: int = 0,
              noise: float = 0.02, scale: float = 1.0, gap: float = 0.0) -> list[dict]:
    """Each rank: data wait, forward, backward, then a collective it enters when its backward ends and leaves when
    the last rank has entered; `slow` spends `extra` more seconds in `phase`, `scale` times as long in forward,
    backward and the optimizer step, and `gap` seconds between its data wait and its forward (in no phase).
    Clocks shifted by `offsets`. `noisy` more collectives follow in each step, each with a random rank late by up
    to `noise` (a busy node)."""
    rng = random.Random(seed)
    offsets = offsets or [0.0] * world
    docs = [{"rank": r, "host": "h", "main": 1, "threads": {"1": "MainThread", "2": "hpctrain-comm"}, "window": f"1:{steps}",
             "clock": {"offset": offsets[r], "error": 1e-6, "at": 0.0}, "startup": [], "steps": []} for r in range(world)]
    t0 = 100.0
    for step in range(1, steps + 1):
        arrive, spans = [], []
        for r in range(world):
            t, mine = t0, []
            for name, base in (("data wait", 0.001), ("forward", 0.005), ("backward", 0.010)):
                d = base + rng.uniform(0, jitter) + (extra if r == slow and name == phase else 0.0)
                d *= scale if r == slow and name != "data wait" else 1.0
                mine.append([name, 1, t, t + d, None])
                t += d + (gap if r == slow and name == "data wait" else 0.0)
            spans.append(mine)
            arrive.append(t)
        leave = max(arrive) + 0.001
        colls: list[list] = [[] for _ in range(world)]
        for k in range(noisy + 1):
            for r in range(world):
                colls[r].append([step * 10 + k, "allreduce", k, 4096, "float32", "gradient allreduce", step,
                                 arrive[r] + offsets[r], arrive[r] + offsets[r], leave + offsets[r], 2])
            late = rng.randrange(world)
            arrive = [leave + (rng.uniform(0, noise) if r == late else rng.uniform(0, jitter)) for r in range(world)]
            leave = max(arrive) + 0.001
        for r in range(world):
            o = offsets[r]
            docs[r]["steps"].append({
                "step": step, "spans": [[n, i, a + o, b + o, x] for n, i, a, b, x in spans[r]]
                + [["wait", 1, colls[r][0][8], leave + o, None],
                   ["optimizer", 1, leave + o, leave + o + 0.002 * (scale if r == slow else 1.0), None]],
                "collectives": colls[r]})
        t0 = leave + 0.003
    return docs


def test_an_injected_straggler_is_named_with_its_phase() -> None:
    found = analyse(make_docs(4, 30, slow=3, phase="backward", extra=0.004))
    assert found["rank"] == 3 and found["phase"] == "backward", found["verdict"]
    assert found["verdict"].startswith("rank 3 is the straggler: backward ") and "% slower than the median" in found["verdict"]
    assert found["last_arrivals"][3] >= 25 and found["made_others_wait_ms_per_step"][3] > 3.0
    found = analyse(make_docs(2, 30, slow=0, phase="data wait", extra=0.05))
    assert found["rank"] == 0 and found["phase"] == "data wait"


def test_a_straggler_is_named_through_the_noise_of_a_busy_node() -> None:
    """As measured on 4 ranks of 2 busy cores: the straggler is late at the first collective of each step, and
    every rank, by turns, is late at the other collectives, together for longer than the straggler: it made the
    others wait the longest in most steps, not for most of the time."""
    for seed in range(5):
        found = analyse(make_docs(4, 30, slow=1, phase="data wait", extra=0.03, noisy=4, seed=seed))
        assert found["rank"] == 1 and found["phase"] == "data wait" and found["share"] < 0.625, found  # most of the waiting: no
        clean = analyse(make_docs(4, 30, extra=0.03, noisy=4, seed=seed))
        assert clean["verdict"] == "no straggler", clean


def test_a_rank_slower_at_everything_is_named_slower_in_every_phase() -> None:
    """As measured beside another job on 2 cores: the rank that shared its core was 43-57 % slower in each phase of
    a 1 ms step and lost more time between them; no phase explains the waiting alone, and "in no traced phase"
    would send the reader looking for work outside the step."""
    found = analyse(make_docs(2, 30, slow=1, extra=0.0, scale=1.3, gap=0.015))
    assert found["rank"] == 1 and found["phase"] == "every phase", found["verdict"]
    assert found["verdict"].startswith("rank 1 is the straggler, slower in every phase (forward +"), found["verdict"]
    assert "whose core is shared with other work or slower" in found["verdict"]
    pct = {p: int(v) for p, v in re.findall(r"(forward|backward|optimizer) \+(\d+) %", found["verdict"])}
    assert set(pct) == {"forward", "backward", "optimizer"} and 25 <= pct["optimizer"] <= 35, pct
    # a gap alone, the phases no slower: still in no traced phase
    found = analyse(make_docs(2, 30, slow=1, extra=0.0, gap=0.008))
    assert found["rank"] == 1 and found["phase"] is None and "in no traced phase" in found["verdict"], found["verdict"]


@pytest.mark.parametrize("seed", range(5))
def test_no_straggler_when_every_rank_only_jitters(seed: int) -> None:
    for world in (2, 4, 8):
        found = analyse(make_docs(world, 40, jitter=0.004, seed=seed))
        assert found["verdict"] == "no straggler" and found["rank"] is None, found


def test_clocks_are_aligned_before_arrivals_are_compared() -> None:
    """Rank 2's clock runs 50 ms ahead: unaligned, it would look late everywhere."""
    docs = make_docs(4, 20, jitter=0.004, offsets=[0.0, 0.0, 0.05, 0.0])
    assert analyse(docs)["verdict"] == "no straggler"
    assert all(abs(c["arrive"][2] - c["arrive"][0]) < 0.02 for c in collectives(docs))
    assert clock_summary(docs)["offset_max_us"] == pytest.approx(50_000)
    drift = aligner({"clock": {"offset": 0.0, "at": 0.0, "offset_end": 0.002, "at_end": 10.0}})
    assert drift(5.0) == pytest.approx(4.999)


def test_brief_keeps_summary_json_small_at_any_world_size() -> None:
    found = analyse(make_docs(16, 5, slow=7, extra=0.02))
    small = brief(found)
    assert not any(isinstance(v, list) for v in small.values()) and len(small["made_others_wait_ms_per_step"]) == 5
    assert "7" in small["made_others_wait_ms_per_step"]


def test_the_chrome_trace_has_a_process_per_rank_lanes_and_arrows_from_the_last_rank() -> None:
    docs = make_docs(3, 4, slow=1, extra=0.01)
    trace = json.loads(json.dumps(chrome_trace(docs, analyse(docs))))  # valid JSON
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(r, f"rank {r} (h)") for r in range(3)}
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, "training loop"), (0, "communication")} <= lanes
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    colls = [e for e in slices if e["cat"] == "collective"]
    assert len(colls) == 12 and all(e["args"]["last_rank"] == 1 for e in colls)
    starts = [e for e in events if e["ph"] == "s"]
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 8 and all(s["pid"] == 1 and ends[s["id"]]["pid"] != 1 for s in starts)
    assert trace["otherData"]["straggler"].startswith("rank 1 is the straggler")


# -- the line-up of flight records -------------------------------------------------------------------------------


def dump(rank: int, rows: list[list], world: int = 3, time: float = 1000.0) -> dict:
    return {"rank": rank, "world": world, "reason": "watchdog", "time": time, "entered": max(r[0] for r in rows) + 1,
            "records": rows}


def row(seq: int, bucket: int, ended: bool = True, op: str = "allreduce") -> list:
    return [seq, op, bucket, 1_000_000, "float32", "gradient allreduce", 5, 1.0, 1.0, 2.0 if ended else 0.0, 7]


def test_the_line_up_names_the_collective_and_the_rank_that_never_arrived() -> None:
    common = [row(s, s % 3) for s in range(10)]
    dumps = {0: dump(0, common + [row(10, 1, ended=False)]), 1: dump(1, common),
             2: dump(2, common + [row(10, 1, ended=False)])}
    found = line_up(3, dumps, {})
    assert found["seq"] == 10 and found["bucket"] == 1 and found["missing"] == [1] and found["waiting"] == [0, 2]
    assert "#10 allreduce of bucket 1 (float32, 1.00 MB) at step 5" in found["text"]
    assert "ranks 0, 2 entered it and were still inside; rank 1 never arrived" in found["text"]


def test_the_line_up_says_what_the_heartbeat_of_a_rank_without_a_record_says() -> None:
    common = [row(s, 0) for s in range(4)]
    dumps = {0: dump(0, common + [row(4, 0, ended=False)], world=2)}
    beats = {1: {"rank": 1, "step": 5, "phase": "gradient allreduce", "time": 970.0}}
    found = line_up(2, dumps, beats)
    assert found["no_record"] == [1] and found["waiting"] == [0]
    assert "rank 1 left no flight record (its heartbeat is silent for 30 s: stopped, dead or killed; last at step 5" \
        in found["text"]


def test_the_line_up_finds_ranks_in_different_collectives_and_agreement() -> None:
    a, b = [row(0, 0), row(1, 1, ended=False)], [row(0, 0), row(1, 2, ended=False)]
    found = line_up(2, {0: dump(0, a, 2), 1: dump(1, b, 2)}, {})
    assert found["seq"] == 1 and "the ranks disagree on collective #1" in found["text"]
    same = [row(s, 0) for s in range(3)]
    found = line_up(2, {0: dump(0, same, 2), 1: dump(1, same, 2)}, {})
    assert found["seq"] is None and "agree up to collective #2" in found["text"]
    # a ring that wrapped: only what every rank still holds is compared
    found = line_up(2, {0: dump(0, [row(s, 0) for s in range(5, 9)] + [row(9, 0, ended=False)], 2),
                        1: dump(1, [row(s, 0) for s in range(2, 9)], 2)}, {})
    assert found["seq"] == 9 and found["missing"] == [1]


# -- the watchdog's dumps ----------------------------------------------------------------------------------------


def test_a_stop_signal_that_finds_the_rank_in_a_wait_dumps_its_flight_record(tmp_path) -> None:
    """A forced stop: the main thread, blocked in MPI, cannot run the signal's handler, yet the watchdog thread
    learns of the signal (the wakeup fd) and dumps the ring while the rank is still in the wait."""
    import os
    import signal
    import time

    from hpctrain.base.stop import FLAG
    from hpctrain.control.watchdog import Watchdog
    from hpctrain.trace.flight import RECORDER

    installed = FLAG.install()
    aborted: list[int] = []
    dog = Watchdog(None, 0, 2, timeout=60, abort=aborted.append, interval=0.1).start()
    try:
        (tmp_path / "logs").mkdir()
        dog.attach(tmp_path)
        seq = RECORDER.begin("allreduce", 0, "float32", nbytes=64)
        dog.phase("gradient allreduce", 7)
        os.kill(os.getpid(), signal.SIGUSR2)
        path = tmp_path / "logs" / "rank-0000.flight.json"
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        doc = json.loads(path.read_text())
        assert doc["reason"].startswith("SIGUSR2 while in gradient allreduce at step 7"), doc["reason"]
        assert doc["records"][-1][0] == seq and doc["records"][-1][FIELDS.index("end")] == 0.0 and aborted == []
    finally:
        RECORDER.end(seq)
        dog.close()
        if installed:
            FLAG.restore()
        FLAG.signum = None
        RECORDER.configure(0, None)


def test_a_rank_that_did_not_run_is_named_even_when_it_dumped_late() -> None:
    """SIGSTOP, then mpirun's teardown (SIGCONT, SIGTERM): the stopped rank dumps after the fact, its collective
    finished; what its watchdog saw (its process did not run for 7 s) names it."""
    finished = [row(s, 0) for s in range(5)]
    late = dump(1, finished, world=3)
    late.update(frozen_s=7.2, frozen_until=999.0)  # it dumped a second after it ran again
    dumps = {0: dump(0, finished[:4] + [row(4, 0, ended=False)]), 1: late, 2: dump(2, finished[:4] + [row(4, 0, ended=False)])}
    found = line_up(3, dumps, {})
    assert found["frozen"] == [1] and found["waiting"] == [0, 2]
    assert "rank 1 did not run for 7 s (stopped, or starved of CPU): the others waited for it" in found["text"]
    late["frozen_until"] = 900.0  # a stall long before the hang says nothing about it
    assert line_up(3, dumps, {})["frozen"] == []
