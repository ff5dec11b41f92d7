#!/usr/bin/env python3
"""What one raw Allreduce costs back to back, after other memory traffic, and where a training step has it
(why the honest limit of `hpctrain bench train` and `benchmarks/step_limit.py` times it in the step).

Run under mpirun, 2 ranks (one torch thread each), the reference MLP's gradient bytes (23.3 MB, float32):
- `back to back`: the same Allreduce of the same numpy buffer over and over, a barrier before each (how the
  limit's allreduce used to be timed);
- `after N MB`: the same, with N MB of other memory written between two allreduces (a step's fused SGD alone
  streams about five times the model's bytes);
- `in the step`: a plain torch step of the reference MLP (`zero_grad(); backward()`, then the fresh gradients
  copied into the buffer, a barrier, the timed Allreduce, then the optimizer step), and a second and third
  Allreduce of the buffer right after the first (how far from back to back the first one is);
- `buckets, backward / forward order`: the same step with the gradients summed as hpctrain's buckets are
  without overlap (each large gradient in its own memory, the small ones packed into one), in backward order
  or in forward order, the gradient backward wrote last first (why `allreduce.WholeGradients` sums them so).
Every figure is the slowest rank's median in milliseconds.

The process has the memory of `train`'s (`hpctrain/base/hostmem.py`): torch's large tensors on huge pages, freed
gradient memory kept for the next step. With `--plain-memory`, glibc's and torch's defaults instead, as a script
without hpctrain has them: there the buckets, in torch memory on 4 KiB pages, took 0.8-1.0 ms more than the one
Allreduce of the numpy buffer (numpy advises huge pages itself), against 0.3-0.6 ms with `train`'s settings
(2026-12-06, docs/performance.md).

    mpirun -n 2 python benchmarks/allreduce_in_step.py [--iters 40] [--plain-memory] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

if "--plain-memory" not in sys.argv:  # before torch allocates: it reads its huge-page setting once
    from hpctrain.base.hostmem import prefer_huge_pages, reuse_freed_memory

    prefer_huge_pages()
    reuse_freed_memory()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

FEATURES, WIDTH, CLASSES, BATCH = 784, 2048, 10, 64


def _timed(comm: MPI.Comm, buf: np.ndarray, before=None) -> float:
    if before is not None:
        before()
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plain-memory", action="store_true", help="glibc's and torch's memory defaults, not train's")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(BATCH, FEATURES), torch.randint(0, CLASSES, (BATCH,))
    buf = np.ones(sum(p.numel() for p in params), np.float32)
    flat = torch.from_numpy(buf)
    times: dict[str, list[float]] = {}

    def keep(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for i in range(args.iters + 3):  # the first three of each: warm-up
        keep("back to back", _timed(comm, buf))
    for mb in (16, 64, 256):
        junk = np.ones(mb * 250_000, np.float32)
        for i in range(args.iters + 3):
            keep(f"after {mb} MB", _timed(comm, buf, lambda: np.add(junk, 1.0, out=junk)))
    for i in range(args.iters + 3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)
        for which in ("in the step", "in the step, the second", "in the step, the third"):
            keep(which, _timed(comm, buf))
        opt.step()
    # hpctrain's buckets without overlap: the two large gradients alone, the small ones packed into one; summed
    # in backward order (the small ones' bucket first, as backward meets its first gradient) or in forward order
    # (the first layer's gradient, which backward wrote last, first), alternating step by step
    small = [p for p in params if p.numel() * 4 < 1 << 18]
    packed = np.zeros(sum(p.numel() for p in small), np.float32)
    large = [p for p in params if p.numel() * 4 >= 1 << 18]  # forward order: W1, W2
    for i in range(2 * (args.iters + 3)):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in small], out=torch.from_numpy(packed))
        which = ("buckets, backward order", [packed, *(p.grad.numpy() for p in large[::-1])]) if i % 2 else (
            "buckets, forward order", [*(p.grad.numpy() for p in large), packed])
        comm.Barrier()
        t0 = time.perf_counter()
        for b in which[1]:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
        keep(which[0], time.perf_counter() - t0)
        opt.step()
    ms = {k: float(comm.allreduce(statistics.median(v[3:]), op=MPI.MAX)) * 1e3 for k, v in times.items()}
    if comm.rank:
        return
    if args.json:
        print(json.dumps({"bytes": buf.nbytes, "ranks": comm.size, "memory": "plain" if args.plain_memory else "train", "allreduce_ms": ms}))
        return
    print(f"one Allreduce of {buf.nbytes / 1e6:.1f} MB on {comm.size} ranks (slowest rank's median of {args.iters}):")
    for k, v in ms.items():
        print(f"  {k:<26} {v:6.2f} ms")


if __name__ == "__main__":
    main()
