"""Each rank's clock against rank 0's, for a timeline of every rank on one time axis.

Rank 0 plays ping-pong with each rank in turn: it sends, the rank answers with its own clock's reading, and
rank 0 takes the midpoint of its send and receive times as the moment of that reading. Of `rounds`
exchanges the one with the shortest round trip is kept: its offset (the rank's clock minus rank 0's) is off
by at most half that round trip, which is the error bound reported with it. The other ranks wait for their
turn without spinning a core (on an oversubscribed node a spinning rank slows the exchange it waits for).
The clock is `time.perf_counter()` (CLOCK_MONOTONIC): on one node every process reads the same clock, so
there the true offset is zero and a measured one is the method's error (docs/performance.md).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .world import Comm

TAG = 28_017  # point-to-point messages of the clock exchange only
ROUNDS = 16


def clock_offsets(comm: Comm, rounds: int = ROUNDS) -> dict[str, float]:
    """This rank's {offset, error, at}: its clock minus rank 0's (seconds), half the round trip of the exchange
    that measured it (the bound of its error), and when (on this rank's clock). Collective; zeros on rank 0."""
    if comm.size == 1:
        return {"offset": 0.0, "error": 0.0, "at": time.perf_counter()}
    if comm.rank == 0:
        results: list[Any] = [{"offset": 0.0, "error": 0.0, "at": time.perf_counter()}]
        results += [_lead(comm, r, rounds) for r in range(1, comm.size)]
    else:
        _follow(comm, rounds)
        results = None
    return comm.mpi.scatter(results, root=0)


def _lead(comm: Comm, rank: int, rounds: int) -> dict[str, float]:
    """Rank 0's side of the exchange with `rank`: the best of `rounds` ping-pongs."""
    buf = np.zeros(1, np.float64)
    comm.mpi.Send(buf, dest=rank, tag=TAG)  # your turn
    best = (float("inf"), 0.0, 0.0)
    for _ in range(rounds):
        t1 = time.perf_counter()
        comm.mpi.Send(buf, dest=rank, tag=TAG)
        comm.mpi.Recv(buf, source=rank, tag=TAG)
        t2 = time.perf_counter()
        if t2 - t1 < best[0]:
            best = (t2 - t1, float(buf[0]) - (t1 + t2) / 2, float(buf[0]))
    return {"offset": best[1], "error": best[0] / 2, "at": best[2]}


def _follow(comm: Comm, rounds: int) -> None:
    """A rank's side: wait for its turn (sleeping between polls), then answer each ping with its clock."""
    buf = np.zeros(1, np.float64)
    turn = comm.mpi.Irecv(buf, source=0, tag=TAG)
    while not turn.Test():
        time.sleep(0.0005)
    for _ in range(rounds):
        comm.mpi.Recv(buf, source=0, tag=TAG)
        buf[0] = time.perf_counter()
        comm.mpi.Send(buf, dest=0, tag=TAG)
