#!/usr/bin/env python3
"""Does a clean traced run name a straggler when another job shares the cores? (why
`tests/mpi/test_trace_mpi.py::test_a_clean_traced_run_has_no_straggler` is marked `alone`)

Runs the test's own command (`train` on the digits in 2 shards, batch 32, 20 steps, `--trace last:15`, 2 ranks)
`--runs` times alone, then as many times beside a loop of another 2-rank `train` (what the other pytest worker's
MPI tests are to it on a 2-core machine), and counts the verdicts. On 2026-12-05, four batches of 20: beside
the loop 2, 4, 0 and 1 named a straggler (the last "slower in every phase (forward +15 %, backward +29 %,
optimizer +24 % ...)"); alone 0 of 25, 0 of 20 and 0 of 20.

    python benchmarks/straggler_under_load.py [--runs 20] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
MPIRUN = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "hpctrain"]


def _verdicts(data: Path, work: Path, runs: int, tag: str) -> list[str]:
    out = []
    for i in range(runs):
        run = work / f"{tag}{i}"
        subprocess.run([*MPIRUN, "train", "--data", str(data), "--run-dir", str(run), "--batch-size", "32",
                        "--max-steps", "20", "--trace", "last:15"], env=ENV, capture_output=True, timeout=300,
                       check=True)
        verdict = json.loads((run / "summary.json").read_text())["straggler"]["verdict"]
        out.append("no straggler" if verdict == "no straggler" else verdict.split(";")[0])
    return out


def _stop(load: subprocess.Popen) -> None:
    """End the load's loop, its mpirun and ranks (one process group): SIGTERM, then SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(load.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            load.poll()
            try:
                os.killpg(load.pid, 0)  # anyone of the group left?
            except ProcessLookupError:
                return
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "digits", str(data), "--shards", "2"], env=ENV,
                       capture_output=True, check=True)
        result = {"alone": _verdicts(data, work, args.runs, "alone")}
        # the load: 2-rank trainings one after another, for as long as the loaded runs take
        loop = ("import subprocess, sys\nwhile True:\n    subprocess.run(sys.argv[1:], capture_output=True)\n")
        load = subprocess.Popen([sys.executable, "-c", loop, *MPIRUN, "train", "--data", str(data), "--run-dir",
                                 str(work / "load"), "--batch-size", "32", "--epochs", "2", "--checkpoint-every", "0"],
                                env=ENV, start_new_session=True)
        try:
            result["beside a loop of train"] = _verdicts(data, work, args.runs, "loaded")
        finally:
            _stop(load)
    if args.json:
        print(json.dumps(result))
        return
    for mode, verdicts in result.items():
        named = sum(v != "no straggler" for v in verdicts)
        print(f"{mode}: a straggler named in {named} of {len(verdicts)} runs")
        for verdict, n in collections.Counter(v for v in verdicts if v != "no straggler").items():
            print(f"  {n} x {verdict}")


if __name__ == "__main__":
    main()
