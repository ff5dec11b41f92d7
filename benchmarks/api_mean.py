#!/usr/bin/env python3
"""What the library API's mean over ranks costs: `DistributedOptimizer` without `scale_loss()` against the same
loop with it (which folds the mean into the loss and needs no division at all), in one process per rank,
alternating blocks of steps, so the machine's drift between launches does not enter the comparison.

The reference MLP (784-2048-2048-10, batch 64 per rank, fused SGD with momentum), 2 ranks, one torch thread each.
Without `scale_loss()` the sum is divided by the world size inside the fused optimizer's kernel where it can be
(`hpctrain.control.step.in_kernel_mean`: every stage, on the CPU), else by a pass over the summed gradients.
Prints each loop's median block (ms a step) and in how many pairs of blocks `scale_loss()` was the faster.

    python benchmarks/api_mean.py [--zero 0|1|2|3] [--blocks 24] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def worker(zero: int, blocks: int, steps: int) -> None:
    import hpctrain  # init() before the model: torch then takes the huge pages hpctrain asks for
    import torch

    ctx = hpctrain.init(threads=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True),
                                        model, zero=zero)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(ctx.rank)
    xs = [torch.randn(64, 784, generator=g) for _ in range(8)]
    ys = [torch.randint(0, 10, (64,), generator=g) for _ in range(8)]
    times: dict[str, list[float]] = {"mean_by_hpctrain": [], "scale_loss": []}
    for b in range(blocks):
        name = "mean_by_hpctrain" if b % 2 == 0 else "scale_loss"
        t0 = time.perf_counter()
        for s in range(steps):
            opt.zero_grad()
            loss = loss_fn(model(xs[s % 8]), ys[s % 8])
            (opt.scale_loss(loss) if name == "scale_loss" else loss).backward()
            opt.step()
        elapsed = (time.perf_counter() - t0) / steps
        times[name].append(float(ctx.comm.allreduce_array([elapsed], op="max")[0]))  # the slowest rank's block
    opt.close()
    if ctx.rank == 0:
        plain, scaled = times["mean_by_hpctrain"][1:], times["scale_loss"][1:]  # the first pair warms up
        print(json.dumps({"zero": zero, "in_kernel": getattr(opt, "_world_scale", None) is not None,
                          "mean_by_hpctrain_ms": statistics.median(plain) * 1e3,
                          "scale_loss_ms": statistics.median(scaled) * 1e3,
                          "scale_loss_faster_pairs": sum(s < p for s, p in zip(scaled, plain)),
                          "pairs": min(len(plain), len(scaled))}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--blocks", type=int, default=24, help="blocks in all, alternating (default 24)")
    parser.add_argument("--steps", type=int, default=40, help="steps a block (default 40)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.zero, args.blocks, args.steps)
        return
    proc = subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, __file__, "--worker",
                           "--zero", str(args.zero), "--blocks", str(args.blocks), "--steps", str(args.steps)],
                          capture_output=True, text=True, env=ENV, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"api_mean: the MPI run failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result))
        return
    print(f"reference MLP, 2 ranks, ZeRO {result['zero']}, {result['pairs']} pairs of {args.steps}-step blocks "
          f"(the mean in the optimizer's kernel: {'yes' if result['in_kernel'] else 'no, a pass'})")
    print(f"  without scale_loss()  {result['mean_by_hpctrain_ms']:.2f} ms a step")
    print(f"  with scale_loss()     {result['scale_loss_ms']:.2f} ms a step "
          f"(faster in {result['scale_loss_faster_pairs']} of {result['pairs']} pairs)")


if __name__ == "__main__":
    main()
