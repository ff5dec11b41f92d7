"""The suite's own tooling: the quick tier `make check` runs, and the count of processes each test file starts
(tests/launchcount.py), by which the suite's time is found."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, PYTHON
from launchcount import ranks_of, table


def test_each_launch_counts_the_interpreters_it_starts() -> None:
    assert ranks_of(["mpirun", "-n", "3", "--oversubscribe", PYTHON, "-m", "hpctrain", "train"]) == 3
    assert ranks_of([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", "d"]) == 3
    assert ranks_of([PYTHON, "-m", "hpctrain", "bench", "train", "-n", "2", "--model", "mlp:64"]) == 3
    assert ranks_of([PYTHON, "-m", "hpctrain", "shard", "digits", "out"]) == 1
    assert ranks_of([sys.executable, "script.py"]) == 1
    assert ranks_of(["sbatch", "--parsable", "job.sh"]) == 0 and ranks_of([]) == 0


def test_the_table_sums_each_file_s_launches_most_first() -> None:
    lines = [json.dumps({"test": t, "interpreters": i}) for t, i in
             [("tests/mpi/a.py::x", 3), ("tests/mpi/a.py::x", 2), ("tests/mpi/b.py::y[1]", 6), ("tests/mpi/b.py::y[2]", 1)]]
    rows = table(lines)
    assert rows[1].split() == ["7", "2", "2", "tests/mpi/b.py"]
    assert rows[2].split() == ["5", "2", "1", "tests/mpi/a.py"]
    assert rows[-1].split() == ["12", "4", "3", "in", "all"]


def test_make_check_runs_the_quick_tier_every_unit_test_and_a_few_mpi_smoke_tests() -> None:
    """`make check` answers in minutes: all of tests/unit and a handful of MPI smoke tests, not the MPI suite."""
    recipe = (ROOT / "Makefile").read_text().split("\ncheck:", 1)[1].split("\n\n", 1)[0]
    assert "-m quick" in recipe and "tests/unit" in recipe and "tests/mpi" in recipe, recipe
    env = {k: v for k, v in os.environ.items() if k != "HPCTRAIN_TEST_LAUNCHES"}  # this run's count is not its
    proc = subprocess.run([PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "quick",
                           "tests/mpi"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    picked = [line for line in proc.stdout.splitlines() if "::" in line]
    assert 3 <= len(picked) <= 8, proc.stdout + proc.stderr
