"""The benchmarks' watchdog: `hpctrain bench` ends, rather than hangs, when a rank stops making progress.

One did sit for an hour: its launcher had died, rank 0 was in gloo's teardown and rank 1 in an MPI barrier.
A benchmark's waits are its measurements, so the deadline is on progress: every timed step re-arms it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from ..base.stop import cancel_deadline, deadline, edge_budget
from ..comm import Comm, world
from ..control.watchdog import Watchdog

_WATCHDOG: Watchdog | None = None  # the benchmark's, while `watched` holds it: every measurement re-arms it


@contextlib.contextmanager
def watched(timeout: float, connect: Callable[[], Comm] = world) -> Iterator[Comm]:
    """The communicator `connect()` gives, with a benchmark run under the trainer's watchdog: a rank that
    makes no progress for `timeout` seconds (0: never) ends the whole job (MPI_Abort), naming what it was
    doing. Every measurement re-arms it: a bench whose peer hangs (in a collective, in gloo's teardown, or
    after its launcher died) ends instead of sitting there (one did for an hour). MPI_Init, where no
    Python thread can watch, has train's start-up deadline (stop.edge_budget)."""
    global _WATCHDOG
    import torch  # noqa: F401 - before the deadline: on a busy node the import alone can outlast it

    deadline(edge_budget(timeout))
    try:
        comm = connect()
        with Watchdog(None, comm.rank, comm.size, timeout=timeout, abort=comm.abort).start() as watchdog:
            cancel_deadline()
            _WATCHDOG = watchdog
            watchdog.at_edge(edge_budget(timeout))  # building the workload: each rank's own, unequal work
            progress("start-up")
            watchdog.at_edge(None)
            try:
                yield comm
            finally:
                _WATCHDOG = None
    finally:
        cancel_deadline()


def current() -> Watchdog | None:
    """The running benchmark's watchdog (None outside `watched`), for code that names its own waits on it
    (`control.lm.flops_and_peak`); call `progress` with a section after it."""
    return _WATCHDOG


def progress(section: str | None = None) -> None:
    """The benchmark is at `section` now (None: still where it was), and progressing: re-arms the deadline."""
    if _WATCHDOG is not None:
        _WATCHDOG.phase(f"bench: {section}" if section else _WATCHDOG.current)
