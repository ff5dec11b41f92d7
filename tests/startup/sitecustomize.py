"""Loaded at start-up by every Python process the tests launch through `mpi_env` (its directory leads
PYTHONPATH).

Each line printed goes out in one write, at once. Under PYTHONUNBUFFERED=1, print() writes its pieces one by one,
and mpirun forwards every rank's writes as they come, so two ranks' lines could break each other
("pid 0 22144pid 1 22145") in the check scripts. The CLI does the same for itself (`hpctrain.cli.main._whole_lines`);
this copy does not import it, since importing the CLI would add about 0.2 s to each of the suite's interpreters.

An MPI rank of a test (or `hpctrain train` alone) then hands itself over to its pytest worker's warm-rank server
(warmranks.py), which has imported torch already, when the worker runs one."""
import os
import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None:
        _stream.reconfigure(write_through=False, line_buffering=True)

if os.environ.get("HPCTRAIN_WARM_RANKS"):
    import warmranks

    warmranks.hand_over()
