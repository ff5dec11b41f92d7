"""The comm layer under real mpirun at 1, 2 and 3 ranks: broadcast, and summed gradients in every mode."""

from pathlib import Path

import pytest

from conftest import mpirun

SCRIPT = Path(__file__).parent / "scripts" / "comm_check.py"


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gradient_sync_and_broadcast(n: int) -> None:
    proc = mpirun(n, [str(SCRIPT)], python_module=False, timeout=240)
    assert f"COMM OK {n} cpu" in proc.stdout


@pytest.mark.mpi
def test_every_rank_takes_part_in_the_start_up_probe_whatever_its_device() -> None:
    proc = mpirun(2, [str(Path(__file__).parent / "scripts" / "probe_check.py")], python_module=False, timeout=120)
    assert proc.stdout.count("PROBE OK") == 2, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_zero_reducer_leaves_each_rank_its_slice_of_the_sum(n: int) -> None:
    """The ring reducer beside MPI's three: equal and unequal slices, fp32 and 16-bit, and the probe times all."""
    proc = mpirun(n, [str(Path(__file__).parent / "scripts" / "reducers_check.py")], python_module=False, timeout=120)
    assert f"REDUCERS OK {n}" in proc.stdout and " ring " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_allreduce_in_pieces_on_one_node_sums_as_one_whole_allreduce(n: int) -> None:
    """fp32 and 16-bit wires, pieces that do not divide the bucket, the same bits on every rank."""
    proc = mpirun(n, [str(Path(__file__).parent / "scripts" / "pieces_check.py")], python_module=False, timeout=120)
    assert f"PIECES OK {n}" in proc.stdout, proc.stdout + proc.stderr
