#!/usr/bin/env python3
"""The gradient engine's allreduce in pieces against whole buckets, in one process (issue 25).

On one node, `Collectives.allreduce` sums a host bucket larger than `PIECE_BYTES` (1 MiB) with one Allreduce per
piece of it (`collectives.Collectives._sum_in_pieces`). This runs `train`'s exact stage-0 step
(`control.step.train_step` on the reference MLP 784-2048-2048-10, batch 64 a rank, SGD as `train` builds it,
the engine `train` builds, no overlap on CPU) and switches the engine between whole buckets and pieces of
`--piece-mb` every round, in turns first, `--steps` timed steps each after one untimed. Both modes run in the
same process on the same memory, so the machine's drift between launches (5-10 % here) cancels. It prints each
mode's median step (ms, rank 0's wall time between two barriers) and the ratio pieces / whole per round (below 1:
the pieces are faster).

    hpctrain launch -n 2 -- python benchmarks/allreduce_pieces.py [--piece-mb 1] [--rounds 10] [--steps 50] [--json]

Measured 2026-12-06 on the 2-core machine (2 ranks, one torch thread each): 0.970 and 0.985 with 1 MiB pieces,
0.986 with 512 KiB, 0.983 with 2 MiB (docs/performance.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from hpctrain.comm.world import world
from hpctrain.control.step import train_step
from hpctrain.tools.bench import _sync_and_optimizer, workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--piece-mb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    comm = world()
    if comm.size < 2:
        raise SystemExit("run it on 2 or more ranks: hpctrain launch -n 2 -- python benchmarks/allreduce_pieces.py")
    torch.set_num_threads(1)
    fresh_model, xs, ys = workload(comm.rank, "mlp:2048,2048", 64, 784, 10, 128, 257)
    batches = itertools.cycle(list(zip(xs, ys)))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    model = fresh_model()
    sync, opt = _sync_and_optimizer(model, comm, 0, "sgd", bucket_mb=25.0, overlap=False, compress="none")
    global_n = ys[0].size * comm.size

    def step() -> None:
        x, y = next(batches)
        train_step(model, sync, opt, loss_fn, x, y, global_n, device="cpu")

    modes = {"whole": 0, "pieces": int(args.piece_mb * 2**20)}
    for _ in range(10):
        step()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for r in range(args.rounds):
        for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            sync.colls.piece_bytes = modes[name]
            step()
            comm.mpi.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            comm.mpi.Barrier()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    sync.close()
    if comm.rank:
        return
    ratios = [p / w for p, w in zip(times["pieces"], times["whole"])]
    result = {"piece_mb": args.piece_mb, "rounds": args.rounds, "steps": args.steps, "ranks": comm.size,
              "step_ms": {k: statistics.median(v) for k, v in times.items()}, "per_round_ms": times,
              "pieces_over_whole": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    if args.json:
        print(json.dumps(result))
        return
    got = result["pieces_over_whole"]
    print(f"reference MLP, {comm.size} ranks, stage 0, {args.rounds} rounds of {args.steps} steps in turns (median):")
    print(f"  whole buckets      {result['step_ms']['whole']:7.2f} ms")
    print(f"  {args.piece_mb:g} MiB pieces     {result['step_ms']['pieces']:7.2f} ms")
    print(f"  pieces / whole     {got['median']:.3f} ({got['min']:.3f}-{got['max']:.3f})")


if __name__ == "__main__":
    main()
