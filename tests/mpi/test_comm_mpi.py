"""The comm layer under real mpirun at 1, 2 and 3 ranks: broadcast, and summed gradients in every mode.

The check scripts of one world size run in one launch (`mpi_checks`): each test asserts its own script's line."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import mpi_checks

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "comm_check.py"


@pytest.fixture(scope="module")
def launched() -> dict:
    """The launch of each world size's checks, made when a test first asks for it."""
    runs: dict = {}

    def at(n: int):
        if n not in runs:
            scripts = [[SCRIPT], [SCRIPTS / "reducers_check.py"], [SCRIPTS / "pieces_check.py"]]
            runs[n] = mpi_checks(n, scripts + ([[SCRIPTS / "probe_check.py"]] if n == 2 else []), timeout=600)
        return runs[n]

    return at


def ok(proc, marker: str, count: int | None = None) -> None:
    """The script printed its line (`count` times, where every rank prints it) and the launch ended well."""
    seen = proc.stdout.count(marker)
    assert (seen == count if count else seen > 0) and proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_gradient_sync_and_broadcast(launched, n: int) -> None:
    ok(launched(n), f"COMM OK {n} cpu")


@pytest.mark.mpi
def test_every_rank_takes_part_in_the_start_up_probe_whatever_its_device(launched) -> None:
    ok(launched(2), "PROBE OK", 2)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_zero_reducer_leaves_each_rank_its_slice_of_the_sum(launched, n: int) -> None:
    """The ring reducer beside MPI's three: equal and unequal slices, fp32 and 16-bit, and the probe times all."""
    proc = launched(n)
    ok(proc, f"REDUCERS OK {n}")
    assert " ring " in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_allreduce_in_pieces_on_one_node_sums_as_one_whole_allreduce(launched, n: int) -> None:
    """fp32 and 16-bit wires, pieces that do not divide the bucket, the same bits on every rank."""
    ok(launched(n), f"PIECES OK {n}")
