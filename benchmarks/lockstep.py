#!/usr/bin/env python3
"""What lockstep costs a plain torch loop (issue 25): the reference MLP's step on every rank, free-running and
with a `Barrier` (no data) after each backward, phase by phase.

The honest limit of `hpctrain bench train` times the ranks' plain torch steps unsynchronized, so their
memory-bound phases (the fused optimizer step) drift apart; any synchronous data-parallel loop runs them in
lockstep, sharing the memory bandwidth. This measures that difference without hpctrain and without moving a
byte between the ranks: the median forward, backward, barrier and optimizer times of each mode, rounds
alternating.

    mpirun -n 2 python benchmarks/lockstep.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

PHASES = ("forward", "backward", "barrier", "optimizer", "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(lockstep: bool) -> list[float]:
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        t1 = time.perf_counter()
        loss_fn(out, y).backward()
        t2 = time.perf_counter()
        if lockstep:
            comm.Barrier()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4))]

    rows: dict[str, list[list[float]]] = {"free-running": [], "lockstep": []}
    for _ in range(opts.rounds):
        for mode in rows:
            comm.Barrier()
            for _ in range(5):
                step(mode == "lockstep")
            times = [step(mode == "lockstep") for _ in range(opts.steps)]
            rows[mode].append([statistics.median(column) for column in zip(*times)])
    if comm.rank == 0:
        print(f"reference MLP, {comm.size} ranks, batch 64, one thread each; median ms per phase, per round")
        print(f"{'mode':>14} " + " ".join(f"{p:>10}" for p in PHASES))
        for mode, rounds in rows.items():
            for r in rounds:
                print(f"{mode:>14} " + " ".join(f"{v:>10.2f}" for v in r))


if __name__ == "__main__":
    main()
