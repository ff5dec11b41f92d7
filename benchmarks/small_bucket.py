#!/usr/bin/env python3
"""Where the small gradients' allreduce goes among the large ones (issue 25): the reference MLP's three
buckets as `train` sums them without overlap (the small gradients packed, 98 KB; the first layer's 6.4 MB
gradient; the second's 16 MB), three ways, each a round in turn after 64 MB of other memory traffic (as a
step's optimizer makes) and a barrier:
- `small_first`: three blocking Allreduces, the packed one first (what `allreduce.WholeGradients` does);
- `small_last`: the same, the packed one last;
- `small_nonblocking`: the packed one as an Iallreduce started first, the two large ones blocking, then its
  Wait (Open MPI progresses it inside the large ones' calls).
Prints the slowest rank's median milliseconds of each. On the 2-core machine (2026-12-05, five launches):
4.53, 4.35, 4.12, 3.87, 4.23 ms non-blocking against 3.92, 4.29, 4.01, 3.78, 4.19 with the packed one first:
no gain, so `train` keeps three blocking calls.

    mpirun -n 2 python benchmarks/small_bucket.py [--rounds 90]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

SIZES = {"small": 98344, "first_layer": 6422528, "second_layer": 16777216}  # bytes, the reference MLP's buckets
MODES = ("small_first", "small_nonblocking", "small_last")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=90, help="rounds in all, the modes in turn (default 90)")
    opts = parser.parse_args()
    comm = MPI.COMM_WORLD
    small, big1, big2 = (np.ones(n // 4, np.float32) for n in SIZES.values())
    other = np.ones(64 << 18, np.float32)  # 64 MB
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(opts.rounds):
        mode = MODES[i % len(MODES)]
        other *= np.float32(1.0000001)
        comm.Barrier()
        t0 = time.perf_counter()
        if mode == "small_first":
            for buf in (small, big1, big2):
                comm.Allreduce(MPI.IN_PLACE, buf)
        elif mode == "small_last":
            for buf in (big1, big2, small):
                comm.Allreduce(MPI.IN_PLACE, buf)
        else:
            request = comm.Iallreduce(MPI.IN_PLACE, small)
            comm.Allreduce(MPI.IN_PLACE, big1)
            comm.Allreduce(MPI.IN_PLACE, big2)
            request.Wait()
        elapsed = time.perf_counter() - t0
        if i >= 3 * len(MODES):  # the first rounds warm up
            times[mode].append(comm.allreduce(elapsed, op=MPI.MAX))
    if comm.rank == 0:
        print("the reference MLP's three gradient buckets, slowest rank's median ms: " + ", ".join(
            f"{m} {statistics.median(v) * 1e3:.2f}" for m, v in times.items()))


if __name__ == "__main__":
    main()
