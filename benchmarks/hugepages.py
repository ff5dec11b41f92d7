#!/usr/bin/env python3
"""What huge pages change in an allreduce of gradient-sized CPU memory (issue 25).

Two ranks sum the reference MLP's gradient bytes (5,824,522 float32, 23 MB) with one raw mpi4py `Allreduce`, in
three kinds of memory: a torch tensor (the memory autograd hands over as a gradient), the same bytes as several
torch tensors (one per parameter, as hpctrain sums large gradients in their own memory), and a numpy array (what
the honest limit of `hpctrain bench train` times its raw allreduce on; numpy advises huge pages for arrays of
4 MiB or more). Each round runs one launch with torch's `THP_MEM_ALLOC_ENABLE=0` and one with `=1` (torch reads it
once per process, so the setting needs its own launch), alternating, and prints the median milliseconds.

`--first-touch` times the other side instead: first touching fresh memory (a 40 MB window, as the shard reader
fills one), advised huge pages (numpy's default for large arrays) or not, several buffers in a row all kept
alive, so every one is fresh memory (in one process, no MPI).

    python benchmarks/hugepages.py [--rounds 3] [--iters 30] [--json]
    python benchmarks/hugepages.py --first-touch [--iters 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [784 * 2048, 2048, 2048 * 2048, 2048, 2048 * 10, 10]  # the reference MLP's parameters
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def worker(iters: int) -> None:
    """One launch: every kind of memory, interleaved, the slowest rank's median ms; rank 0 prints JSON."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    total = sum(SIZES)
    kinds = {
        "torch": [torch.zeros(total).numpy()],
        "torch_per_parameter": [torch.zeros(n).numpy() for n in reversed(SIZES)],
        "numpy": [np.zeros(total, np.float32)],
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(iters):
        for name, bufs in kinds.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for buf in bufs:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times[name].append(time.perf_counter() - t0)
    out = {k: comm.allreduce(statistics.median(v[2:]) * 1e3, op=MPI.MAX) for k, v in times.items()}
    out["page_aligned"] = kinds["torch"][0].ctypes.data % 4096 == 0
    if comm.rank == 0:
        print(json.dumps(out))


def first_touch(iters: int) -> dict[str, list[float]]:
    """Milliseconds to allocate and fill each of `iters` fresh 40 MB numpy arrays, kept alive, with and without
    numpy's huge-page advice (in a child process each, so neither inherits the other's freed memory)."""
    code = ("import json, sys, time, numpy as np\n"
            "np._core.multiarray._set_madvise_hugepage(sys.argv[1] == '1')\n"
            "kept, out = [], []\n"
            f"for _ in range({iters}):\n"
            "    t0 = time.perf_counter(); a = np.empty((12800, 784), np.float32); a.fill(0)\n"
            "    out.append((time.perf_counter() - t0) * 1e3); kept.append(a)\n"
            "print(json.dumps(out))\n")
    return {name: json.loads(subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True,
                                            check=True, timeout=300).stdout)
            for name, flag in (("huge pages advised", "1"), ("4 KiB pages", "0"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--first-touch", action="store_true", help="time first touching fresh memory instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iters)
        return
    if args.first_touch:
        got = first_touch(min(args.iters, 12))
        if args.json:
            print(json.dumps(got))
            return
        print("first touch of fresh 40 MB numpy arrays (12,800 x 784 float32), each kept alive; ms each:")
        for name, times in got.items():
            print(f"  {name:<20} " + ", ".join(f"{t:.1f}" for t in times))
        return
    rows: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
    for _ in range(args.rounds):
        for setting in rows:
            proc = subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, __file__, "--worker",
                                   "--iters", str(args.iters)], capture_output=True, text=True, timeout=600,
                                  env=dict(ENV, THP_MEM_ALLOC_ENABLE=setting), check=False)
            if proc.returncode:
                raise SystemExit(f"mpirun exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
            rows[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {f"THP_MEM_ALLOC_ENABLE={s}": {k: statistics.median(r[k] for r in runs)
                                             for k in ("torch", "torch_per_parameter", "numpy")}
               for s, runs in rows.items()}
    if args.json:
        print(json.dumps({"summary": summary, "rounds": rows}))
        return
    print(f"one raw Allreduce of the reference MLP's gradient bytes (23 MB), 2 ranks; median ms of {args.rounds} "
          "launches each (alternating)")
    print(f"{'setting':<24}{'torch':>10}{'per param':>12}{'numpy':>10}")
    for setting, row in summary.items():
        print(f"{setting:<24}{row['torch']:>10.2f}{row['torch_per_parameter']:>12.2f}{row['numpy']:>10.2f}")


if __name__ == "__main__":
    main()
