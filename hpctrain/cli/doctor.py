"""`hpctrain doctor` (issue 6: being written)."""

from .common import handle_errors


@handle_errors
def doctor() -> None:
    """Check MPI, mpi4py, CUDA-aware support, GPUs, Slurm, HDF5 and threads.

    Example: hpctrain doctor --json
    """
    print("doctor: not written yet")
