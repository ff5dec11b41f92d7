#!/usr/bin/env python3
"""Where the optimizer step goes in a data-parallel step (issue 25): three orders of the same plain torch step of
the reference MLP (784-2048-2048-10, batch 64, fused SGD with momentum, one thread a rank), in alternating
blocks in one launch, so the machine's drift falls on all three alike:

- `after`: backward, every gradient summed (one raw in-place `Allreduce` each, in forward order as
  `hpctrain train` sums them without overlap), then one fused step over every parameter (what `train` does);
- `per-gradient`: backward, then each large gradient summed and at once stepped by its own fused optimizer,
  while the sum is in cache (the small ones packed into one sum and one step first);
- `deferred`: backward and the sums, and each layer's step run by a forward pre-hook just before that layer's
  next forward (its weights in cache for the matmul; PyTorch's "optimizer in the forward" trick);
- `pieces`: as `after`, each large gradient summed in 1 MiB pieces (as hpctrain's engine sums it), then one
  fused step;
- `per-piece`: each 1 MiB piece stepped by the fused kernel on the matching slices of its parameter and
  momentum right after the piece's sum, while the piece is in the core's cache (a gradient read from cache
  instead of memory: a fifth of the optimizer's memory traffic).

Each mode keeps its own parameters and optimizer state (their sums are the same on every rank, so the ranks
stay in sync). It prints each mode's median ms a step over the blocks, and in how many blocks each other mode
beat `after`.

    mpirun -n 2 python benchmarks/step_order.py [--blocks 16] [--steps 30] [--train-memory] [--json]

`--train-memory` gives the process `train`'s allocator settings (hpctrain/base/hostmem.py: huge pages for
large tensors, freed memory kept for the next step), under which the sums run as in `train`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from mpi4py import MPI

FEATURES, WIDTH, CLASSES, BATCH, LR = 784, 2048, 10, 64, 0.01
LARGE = 1 << 16  # elements: a gradient of 256 KiB or more is summed in its own memory, as hpctrain does
PIECE = 1 << 18  # elements: hpctrain's engine sums a large gradient in 1 MiB pieces
MODES = ("after", "per-gradient", "deferred", "pieces", "per-piece")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9, fused=True)


class Mode:
    """One order of the step, on its own copy of the model."""

    def __init__(self, comm: MPI.Comm, name: str) -> None:
        self.comm, self.name = comm, name
        self.model = _model()
        self.params = list(self.model.parameters())
        self.large = [p for p in self.params if p.numel() >= LARGE]
        self.small = [p for p in self.params if p.numel() < LARGE]
        self.lins = [m for m in self.model if isinstance(m, torch.nn.Linear)]
        self.opt = _sgd(self.params)
        self.opts = [_sgd([p]) for p in self.large] + [_sgd(self.small)]
        self.layer_opts = [_sgd(list(m.parameters())) for m in self.lins]
        self.pending = False
        self.hooks = [m.register_forward_pre_hook(self._pre(i)) for i, m in enumerate(self.lins)] \
            if name == "deferred" else []

    def _pre(self, i: int) -> Callable:
        def hook(_module: torch.nn.Module, _inputs: object) -> None:
            if self.pending:
                self.layer_opts[i].step()
        return hook

    def _sum_small(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.small])
        self.comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        parts = flat.split([p.numel() for p in self.small])
        torch._foreach_copy_([p.grad for p in self.small], [t.view_as(p) for t, p in zip(parts, self.small)])

    def _sum(self, p: torch.Tensor) -> None:
        self.comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)

    def _sum_pieces(self, p: torch.Tensor, step: bool) -> None:
        flat = p.grad.reshape(-1).numpy()
        if step:
            param, grad = p.detach().view(-1), p.grad.view(-1)
            momentum = self.opt.state[p]["momentum_buffer"].view(-1)
        for a in range(0, flat.size, PIECE):
            self.comm.Allreduce(MPI.IN_PLACE, flat[a:a + PIECE], op=MPI.SUM)
            if step:
                torch._fused_sgd_([param[a:a + PIECE]], [grad[a:a + PIECE]], [momentum[a:a + PIECE]],
                                  weight_decay=0.0, momentum=0.9, lr=LR, dampening=0.0, nesterov=False,
                                  maximize=False, is_first_step=False)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        out = self.model(x)  # `deferred`: the pending step of each layer runs here, just before its forward
        self.pending = False
        for p in self.params:
            p.grad = None
        torch.nn.functional.cross_entropy(out, y).backward()
        if self.name == "per-gradient":
            self._sum_small()
            self.opts[-1].step()
            for p, opt in zip(self.large, self.opts):
                self._sum(p)
                opt.step()
            return
        if self.name == "per-piece" and self.opt.state:  # the first step makes the momentum buffers
            self._sum_small()
            self.opts[-1].step()
            for p in self.large:
                self._sum_pieces(p, step=True)
            return
        self._sum_small()
        for p in self.large:  # forward order: the gradient backward wrote last first
            if self.name in ("pieces", "per-piece"):
                self._sum_pieces(p, step=False)
            else:
                self._sum(p)
        if self.name in ("after", "pieces", "per-piece"):
            self.opt.step()
        else:
            self.pending = True

    def flush(self) -> None:
        """Run a pending deferred step (at a block's end, so every block does the same number of updates)."""
        if self.pending:
            for opt in self.layer_opts:
                opt.step()
            self.pending = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="steps a block")
    ap.add_argument("--train-memory", action="store_true", help="`train`'s allocator settings (before any tensor)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.train_memory:
        from hpctrain.base import hostmem

        hostmem.prefer_huge_pages()
        hostmem.reuse_freed_memory()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    gen = torch.Generator().manual_seed(1 + comm.rank)
    x, y = torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)
    modes = [Mode(comm, name) for name in MODES]
    for mode in modes:  # warm-up: the allocator's pools, the kernels' first calls
        for _ in range(5):
            mode.step(x, y)
        mode.flush()
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    for block in range(args.blocks):
        order = modes if block % 2 == 0 else modes[::-1]
        for mode in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                mode.step(x, y)
            mode.flush()
            comm.Barrier()
            times[mode.name].append((time.perf_counter() - t0) / args.steps * 1e3)
    if comm.rank:
        return
    result = {name: {"median_ms": statistics.median(v), "blocks": v} for name, v in times.items()}
    for name in MODES[1:]:
        result[name]["beat_after"] = sum(a < b for a, b in zip(times[name], times["after"]))
    if args.json:
        print(json.dumps(result))
        return
    print(f"reference MLP, {comm.size} ranks, batch {BATCH}/rank, {args.blocks} alternating blocks of {args.steps} steps")
    for name, r in result.items():
        beat = f"  (faster than `after` in {r['beat_after']} of {args.blocks} blocks)" if "beat_after" in r else ""
        print(f"  {name:13s} {r['median_ms']:7.2f} ms a step{beat}")


if __name__ == "__main__":
    main()
