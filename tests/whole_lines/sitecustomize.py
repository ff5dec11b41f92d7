"""Loaded at start-up by every Python process the tests launch through `mpi_env` (its directory leads
PYTHONPATH): each line printed goes out in one write, at once. Under PYTHONUNBUFFERED=1, print() writes its pieces
one by one, and mpirun forwards every rank's writes as they come, so two ranks' lines could break each other
("pid 0 22144pid 1 22145") in the check scripts. The CLI does the same for itself (`hpctrain.cli.main._whole_lines`);
this copy does not import it, since importing the CLI would add about 0.2 s to each of the suite's interpreters."""
import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None:
        _stream.reconfigure(write_through=False, line_buffering=True)
