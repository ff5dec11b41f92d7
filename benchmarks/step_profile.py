#!/usr/bin/env python3
"""Where a step's time goes outside torch's and MPI's work (issue 25): three views, each of one run.

- `api`: the library API's loop on the reference MLP (784-2048-2048-10, batch 64 a rank, fused SGD with
  momentum), each phase timed over 150 steps (zero_grad, forward, backward, step: the sum and the optimizer),
  then `cProfile` over 100 more on rank 0: the functions with the most time of their own.
      mpirun -n 2 python benchmarks/step_profile.py api
- `train ARGS`: `hpctrain train ARGS` under `cProfile` on every rank; rank 0 prints the training loop's
  callees (what each step calls besides the step, and for how long) and the functions with the most time of
  their own.
      mpirun -n 2 python benchmarks/step_profile.py train --data DIR --run-dir RUN --max-steps 300 ...
- `trace RUN`: a traced run's timelines (`RUN/trace/rank-*.json`, `train ... --trace A:B`) step by step: each rank's phases,
  the time between one step's optimizer and the next step's batch (the agreement, the scheduler, the run
  log), the gaps between phases, and their medians.
      python benchmarks/step_profile.py trace RUN

Measured on the 2-core CI machine (2026-12-06, docs/performance.md): Python outside torch and MPI 0.1 ms a
step in the API's loop, `zero_grad()` 0.03 ms; in `train` 0.21-0.33 ms between steps, 0.15 ms between phases.
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

PHASES = ("data wait", "zero", "forward", "backward", "wait", "optimizer")


def api() -> None:
    import torch

    import hpctrain

    ctx = hpctrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True), model)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(20):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    spent = dict.fromkeys(("zero_grad", "forward", "backward", "step"), 0.0)
    for _ in range(150):
        t0 = time.perf_counter()
        opt.zero_grad()
        t1 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[key] += dt
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    profile.disable()
    if ctx.rank == 0:
        print("ms a step, rank 0: " + ", ".join(f"{k} {v / 150 * 1e3:.3f}" for k, v in spent.items()))
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def train(argv: list[str]) -> None:
    from hpctrain.cli.main import app

    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    profile = cProfile.Profile()
    profile.enable()
    try:
        app(["train", *argv], standalone_mode=False)
    finally:
        profile.disable()
    if rank == "0":
        stats = pstats.Stats(profile)
        stats.sort_stats("cumtime").print_callees("trainer.py:.*[(]_loop[)]")
        stats.sort_stats("tottime").print_stats(20)


def trace(run: Path) -> None:
    from hpctrain.trace.chrome import read_ranks

    docs = read_ranks(run / "trace")
    if not docs:
        raise SystemExit(f"{run / 'trace'} holds no timeline files: trace the run (`train ... --trace A:B`)")
    # {rank: {step: {phase: (start, end) in ms}}}: each rank's spans on its own clock, which is all a gap needs
    spans = {d["rank"]: {st["step"]: {name: (a * 1e3, b * 1e3) for name, _ident, a, b, _args in st["spans"]}
                         for st in d["steps"]} for d in docs}
    steps = sorted({step for per in spans.values() for step in per})
    print("step  " + " | ".join(f"rank {r}: " + " ".join(f"{p[:6]:>6}" for p in PHASES) + "  between" for r in spans))
    between: dict[int, list[float]] = collections.defaultdict(list)
    inside: dict[int, list[float]] = collections.defaultdict(list)
    for step in steps:
        cells = []
        for r, per in spans.items():
            now, nxt = per.get(step, {}), per.get(step + 1, {})
            row = " ".join(f"{now[p][1] - now[p][0]:6.2f}" if p in now else "     -" for p in PHASES)
            gap = "      -"
            if "optimizer" in now and "data wait" in nxt:
                between[r].append(nxt["data wait"][0] - now["optimizer"][1])
                gap = f"{between[r][-1]:7.3f}"
            if all(p in now for p in PHASES):
                inside[r].append(sum(now[b][0] - now[a][1] for a, b in zip(PHASES, PHASES[1:])))
            cells.append(f"rank {r}: {row}  {gap}")
        print(f"{step:<5} " + " | ".join(cells))
    for r, per in spans.items():
        medians = {p: statistics.median([v[p][1] - v[p][0] for v in per.values() if p in v]) for p in PHASES}
        print(f"rank {r} medians (ms): " + ", ".join(f"{p} {m:.2f}" for p, m in medians.items())
              + (f"; between steps {statistics.median(between[r]):.3f}" if between[r] else "")
              + (f"; between phases {statistics.median(inside[r]):.3f}" if inside[r] else ""))


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("api", "train", "trace") or (sys.argv[1] == "trace" and len(sys.argv) != 3):
        raise SystemExit(__doc__)
    if sys.argv[1] == "api":
        api()
    elif sys.argv[1] == "train":
        train(sys.argv[2:])
    else:
        trace(Path(sys.argv[2]))


if __name__ == "__main__":
    main()
