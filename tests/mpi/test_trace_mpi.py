"""The timeline and the flight recorder on real ranks: `train --trace` with an injected straggler (named, with
its phase, in summary.json, the Chrome trace and the report), a clean traced run ("no straggler"), and an
injected hang lined up from the ranks' flight records (by the abort message and by `hpctrain report`).

The injections are the test hooks of base/rankenv.py, strong on purpose so that the verdicts cannot be noise:
a 60 ms sleep per step in one rank's data path (a step of digits takes a few ms), and a rank that never enters
one collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import hpctrain, mpi_env, mpirun, summary

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def digits4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits4") / "data"
    hpctrain(["shard", "digits", str(out), "--shards", "4", "--val-fraction", "0.1"])
    return out


@pytest.fixture(scope="module")
def straggled(digits4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks, steps 3-14 traced, rank 2 sleeping 60 ms in its data path before every step."""
    run = tmp_path_factory.mktemp("trace") / "run"
    mpirun(4, ["train", "--data", str(digits4), "--run-dir", str(run), "--batch-size", "16", "--max-steps", "16",
               "--trace", "3:14", "--checkpoint-every", "0"], timeout=180, env=mpi_env(HPCTRAIN_TEST_STRAGGLER="2:0.06"))
    return run


def test_the_straggler_is_named_with_its_phase(straggled: Path) -> None:
    found = summary(straggled)["straggler"]
    assert found["rank"] == 2 and found["phase"] == "data wait", found
    assert found["verdict"].startswith("rank 2 is the straggler: data wait") and found["steps"] == 12
    assert found["made_others_wait_ms_per_step"]["2"] > 30, found


def test_the_merged_trace_is_a_chrome_trace_of_every_rank(straggled: Path) -> None:
    trace = json.loads((straggled / "trace.json").read_text())
    assert summary(straggled)["trace"]["bytes"] == (straggled / "trace.json").stat().st_size < 1_000_000
    events = trace["traceEvents"]
    assert {e["pid"] for e in events if e["name"] == "process_name"} == {0, 1, 2, 3}
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "training loop" in lanes
    phases = {e["name"] for e in events if e.get("cat") == "phase"}
    assert {"data wait", "forward", "backward", "wait", "optimizer"} <= phases
    steps = {e["args"]["step"] for e in events if e.get("cat") == "phase" and e["name"] == "forward"}
    assert steps == set(range(3, 15))
    colls = [e for e in events if e.get("cat") == "collective"]
    assert colls and all({"seq", "op", "bytes", "dtype", "step", "waited_for_last_ms"} <= set(e["args"]) for e in colls)
    # Each arrow starts at the slice of the collective's last rank to arrive. The gradient allreduce is the one the
    # straggler's 60 ms made the others wait for: its arrows, 3 a step, all start at rank 2. (The agreement after it
    # finds the ranks in step, so its last rank is chance: which rank draws those arrows is not asserted.)
    slices = {(e["pid"], e["tid"], e["ts"]): e for e in colls}
    flows = [e for e in events if e["ph"] == "s"]
    assert all((e["pid"], e["tid"], e["ts"]) in slices for e in flows)
    grads = [e for e in flows if slices[e["pid"], e["tid"], e["ts"]]["args"]["phase"] == "gradient allreduce"]
    assert len(grads) == 3 * len(steps) and {e["pid"] for e in grads} == {2}
    assert sorted(p.name for p in (straggled / "trace").iterdir()) == [f"rank-000{r}.json" for r in range(4)]


def test_the_report_shows_the_verdict_and_its_plot(straggled: Path, tmp_path: Path) -> None:
    proc = hpctrain(["report", str(straggled), "-o", str(tmp_path / "out")])
    assert "straggler: rank 2 is the straggler: data wait" in proc.stdout, proc.stdout
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Timeline (--trace)" in md and "(straggler.png)" in md
    assert (tmp_path / "out" / "straggler.png").read_bytes()[:4] == b"\x89PNG"


# Alone: beside the other pytest worker's ranks on 2 cores, a rank that shares its core is slower in every phase
# step after step, and the verdict rightly names it; alone, a clean run has none.
@pytest.mark.alone
def test_a_clean_traced_run_has_no_straggler(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--batch-size", "32", "--max-steps", "20",
                      "--trace", "last:15"], timeout=120)
    assert "straggler: no straggler" in proc.stdout, proc.stdout
    got = summary(run)
    assert got["straggler"]["verdict"] == "no straggler" and got["straggler"]["steps"] == 15
    assert got["trace"]["clock"]["error_max_us"] > 0


def test_a_hang_is_lined_up_naming_the_collective_and_the_rank_that_never_arrived(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--batch-size", "32", "--epochs", "3",
                      "--collective-timeout", "5"], check=False, timeout=120, env=mpi_env(HPCTRAIN_TEST_HANG="1:4:0"))
    assert proc.returncode != 0
    named = "allreduce of bucket 0 (float32) at step 4 (gradient allreduce): rank 0 entered it and was still inside; " \
            "rank 1 never arrived"
    assert named in proc.stderr, proc.stderr  # rank 0's abort message lines the dumps up
    assert sorted(p.name for p in (run / "logs").glob("*.flight.json")) == ["rank-0000.flight.json", "rank-0001.flight.json"]
    report = hpctrain(["report", str(run)])
    assert f"flight records: the ranks diverge at collective #" in report.stdout and named in report.stdout, report.stdout
