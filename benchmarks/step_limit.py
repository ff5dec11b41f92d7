#!/usr/bin/env python3
"""The step against the honest limit, DDP and Horovod, in one run (issue 25).

Reference workload: MLP 784-2048-2048-10, batch 64 per rank, 2 ranks, SGD (momentum 0.9, lr 0.01, the
fused kernel `train` builds), one torch thread per core a rank owns. Every round runs the limit and
`train` side by side, in turns first (the machine's speed drifts over minutes), then the other loops:
- the honest limit: two plain torch processes at once (`zero_grad(); loss.backward(); step()`, no hpctrain
  code), each timing every step, then one raw mpi4py `Allreduce` of all gradient bytes (added to the step
  where overlap cannot hide it: one core per rank), timed where a step has it: between backward and the
  optimizer step of the same plain step, on one buffer the fresh gradients were copied into, after a barrier
  (neither timed), in a process of its own with hpctrain's allocator settings (the faster for it).
  Timed back to back it runs from warm caches, much faster than any step sees it; that limit is printed
  beside (`limit_back_to_back`). A loop's step is the mean of its steps on its slowest rank, since `train`'s
  wall-time difference is a mean too: its slow steps count, and so must the limit's. The limit of the
  medians is printed beside it;
- the limit in lockstep (`limit_in_lockstep`, printed beside, not the limit): the plain loop with an MPI
  `Barrier` at the end of every step (`lockstep`), plus the same raw allreduce. A synchronous step cannot
  end before the slower rank's: the barrier makes every step the slower rank's, which two free-running
  plain loops never pay. `lockstep` minus `plain` is that cost alone; `train` over `limit_in_lockstep` is
  what hpctrain adds to a synchronous step on top of what the hardware does;
- the loop a user writes by hand: the same plain step with one raw in-place `Allreduce` of each gradient
  between backward and the optimizer step (not the limit: it also pays the ranks' waits for each other's
  slowest step, every step, which the limit's separately timed loops leave out);
- hpctrain from outside: `hpctrain launch -n 2 -- train`, the wall time of a long minus a short run over
  the step difference (start-up and the end cancel: `train`), and the same difference of the training
  loop's own wall time, `summary.json`'s `train_time_s` (`train_loop`: every step with everything between
  steps, epoch boundaries and logged windows included, without the launch's start-up and end, which vary
  from one launch to the next);
- `train_zero1`: the same with `--zero 1` (each rank steps its slice of the optimizer and the parameters are
  allgathered, where stage 0, the default, steps the whole model on every rank: which is faster on CPUs);
- hpctrain's library API: the custom loop a user writes with `DistributedOptimizer` (stage 0, its default);
- torch DDP (gloo), the same loop as users write it;
- Horovod's own benchmark loop (its `pytorch_synthetic_benchmark.py` loop: zero_grad, forward, cross
  entropy, backward, step through `hvd.DistributedOptimizer`) when `--horovod-python` names a Python with
  Horovod (0.28.1 built from its PyPI sdist against the same Open MPI: `bash benchmarks/build_horovod.sh`).
It prints each one's step time (the median over the rounds) and its ratio to the limit (or hpctrain's to it)
with the spread over the rounds.

Every loop is timed over as many steps as `train`'s long-minus-short difference: a loop timed over far fewer
steps than `train` draws its per-round ratio mostly from which of the machine's fast or slow seconds the short
sample fell on. The figures and how to read them: docs/performance.md.

    python benchmarks/step_limit.py [--rounds 5] [--long 190] [--horovod-python /opt/hvd/bin/python] [--json]

`--loops train,api` runs only those loops (any of limit, train, train_zero1, handwritten, api, ddp, horovod), alternating their
order from round to round, and prints each one's median and their ratios to the first: whether `train` costs
more than the library API's loop, say, without the minutes the other loops take.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
RANKS, BATCH, FEATURES, CLASSES, WIDTH = 2, 64, 784, 10, 2048


def _threads() -> int:
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def _mlp() -> "object":
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def _batches(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(8)]


def _timed(step, batches: list, steps: int) -> tuple[float, float]:
    """(the mean, the median) seconds of `steps` steps after 5 warm-up steps. The mean is what `train`'s
    long-minus-short difference measures (every step's time, the slow ones included); the median leaves a
    loop's slow steps out, which the wall time of `train` cannot."""
    times = []
    for i in range(steps + 5):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        step(x, y)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.mean(times), statistics.median(times)


def worker(kind: str, steps: int) -> None:
    """One rank of a measured loop; rank 0 prints {"step_ms": the slowest rank's mean, "median_step_ms": the
    slowest rank's median, ...} as JSON."""
    if kind == "api":  # tuned before the model is built, as at a script's top: torch then takes the huge pages
        import hpctrain  # hpctrain asks for (hpctrain/base/hostmem.py)

        hpctrain.tune_host_memory()
    import torch

    torch.set_num_threads(_threads())
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    model, batches = _mlp(), _batches(rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    out: dict[str, float] = {}
    if kind == "horovod":
        import horovod.torch as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        gather = lambda v: max(hvd.allgather_object(v))  # noqa: E731
    elif kind == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['STEP_LIMIT_PORT']}", rank=rank,
                                world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

        def gather(v: float) -> float:
            values = [None] * size
            dist.all_gather_object(values, v)
            return max(values)
    elif kind == "api":
        import hpctrain

        ctx = hpctrain.init()
        hpctrain.broadcast_parameters(model)
        opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True),
                                            model)
        gather = lambda v: float(ctx.comm.allreduce_array([v], op="max")[0])  # noqa: E731
    else:  # plain torch (then one raw allreduce of all gradient bytes), in lockstep, or the hand-written loop
        from mpi4py import MPI
        import numpy as np

        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
        gather = lambda v: MPI.COMM_WORLD.allreduce(v, op=MPI.MAX)  # noqa: E731
        MPI.COMM_WORLD.Barrier()

    params = list(model.parameters())

    def step(x, y) -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if kind == "handwritten":
            for p in reversed(params):
                MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        opt.step()
        if kind == "lockstep":
            MPI.COMM_WORLD.Barrier()

    mean_s, median_s = _timed(step, batches, steps)
    out["step_ms"], out["median_step_ms"] = gather(mean_s) * 1e3, gather(median_s) * 1e3
    if kind == "plain":
        grads = np.ones(sum(p.numel() for p in model.parameters()), np.float32)
        MPI.COMM_WORLD.Barrier()
        times = []
        for i in range(25):
            t0 = time.perf_counter()
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        out["raw_allreduce_back_to_back_ms"] = gather(statistics.mean(times)) * 1e3
        out["median_raw_allreduce_back_to_back_ms"] = gather(statistics.median(times)) * 1e3
    if rank == 0:
        print(json.dumps(out), flush=True)
    if kind == "ddp":  # gloo's threads torn down at exit now and then end a rank in std::terminate (exit 134,
        dist.barrier()  # "terminate called without an active exception", destroy_process_group() or not): both
        sys.stdout.flush()  # ranks are done, so they leave without running C++ destructors
        os._exit(0)


def allreduce_worker(steps: int) -> None:
    """The limit's allreduce where a step has it: the plain torch step, with one raw `Allreduce` of all gradient
    bytes between backward and the optimizer step, on one numpy buffer the fresh gradients were copied into
    (untimed), after a barrier (untimed: no rank's wait for another is in it). Run with hpctrain's allocator
    settings as environment variables (`_mpirun`'s `TUNED`): in a process with glibc's defaults it took
    9.1-9.4 ms against 5.2 ms, and the limit takes the faster. Rank 0 prints {"raw_allreduce_ms": the slowest
    rank's mean, "median_raw_allreduce_ms": its median} as JSON."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(_threads())
    comm, model, loss_fn = MPI.COMM_WORLD, _mlp(), torch.nn.CrossEntropyLoss()
    batches = _batches(comm.rank)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    grads = np.zeros(sum(p.numel() for p in params), np.float32)
    flat, times = torch.from_numpy(grads), []
    for i in range(steps + 5):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        if i >= 5:
            times.append(time.perf_counter() - t0)
        opt.step()
    out = {"raw_allreduce_ms": comm.allreduce(statistics.mean(times), op=MPI.MAX) * 1e3,
           "median_raw_allreduce_ms": comm.allreduce(statistics.median(times), op=MPI.MAX) * 1e3}
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


# hpctrain's allocator settings (hpctrain/base/hostmem.py) as environment variables, for the limit's allreduce
TUNED = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _mpirun(python: str, kind: str, steps: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(["mpirun", "-n", str(RANKS), "--bind-to", "none", python, __file__, "--worker", kind,
                           "--steps", str(steps)], capture_output=True, text=True, timeout=600,
                          env=dict(ENV, STEP_LIMIT_PORT=str(port), **(TUNED if kind == "allreduce" else {})))
    if proc.returncode:
        raise SystemExit(f"{kind} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _train_s(data: Path, run: Path, steps: int, extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(the launch's wall seconds, its training loop's: summary.json's train_time_s); `extra`: more flags."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hpctrain", "launch", "-n", str(RANKS), "--", "train", "--data", str(data),
                    "--run-dir", str(run), "--model", f"mlp:{WIDTH},{WIDTH}", "--batch-size", str(BATCH),
                    "--max-steps", str(steps), "--epochs", "100", "--lr", "0.01", "--checkpoint-every", "0",
                    "--resume", "never", "--log-every", "50", *extra], check=True, capture_output=True, env=ENV, timeout=600)
    wall = time.perf_counter() - t0
    return wall, json.loads((run / "summary.json").read_text())["train_time_s"]


def _shard(tmp: Path) -> Path:
    """The reference workload's synthetic data in `tmp`/data: 200 steps an epoch, a shard per rank, no validation."""
    data = tmp / "data"
    subprocess.run([sys.executable, "-m", "hpctrain", "shard", f"synthetic:{RANKS * BATCH * 200}:{FEATURES}:{CLASSES}",
                    str(data), "--shards", str(RANKS), "--val-fraction", "0"], check=True, capture_output=True)
    return data


def _train_step_ms(data: Path, where: Path, long: int, extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """`train`'s ms a step from outside: (the launches' wall time, the loops' `train_time_s`) of a `long`-step run
    minus a 40-step run, over the step difference; the runs in `where`."""
    long_s = _train_s(data, where / "long", long, extra)
    short_s = _train_s(data, where / "short", 40, extra)
    return ((long_s[0] - short_s[0]) / (long - 40) * 1e3, (long_s[1] - short_s[1]) / (long - 40) * 1e3)


LOOPS = ("limit", "train", "train_zero1", "handwritten", "api", "ddp", "horovod")


def _some_loops(args: argparse.Namespace, loops: list[str], rows: dict[str, list[float]], limit: Any,
                train: Any) -> None:
    """`--loops`: only `loops`, in turns (round r starts at loop r mod n), each loop's median and its ratio
    per round to the first loop."""
    for r in range(args.rounds):
        for kind in loops[r % len(loops):] + loops[:r % len(loops)]:
            if kind == "limit":
                limit()
            elif kind in ("train", "train_zero1"):
                train(r, kind)
            else:
                got = _mpirun(args.horovod_python if kind == "horovod" else sys.executable, kind, args.steps)
                rows[kind].append(got["step_ms"])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {rows[k][-1]:.1f}" for k in loops),
              file=sys.stderr, flush=True)
    first = loops[0]
    ratios = {f"{k}_over_{first}": [a / b for a, b in zip(rows[k], rows[first])] for k in loops[1:]}
    result = {"rounds": args.rounds, "step_ms": {k: statistics.median(rows[k]) for k in loops},
              "per_round_ms": {k: rows[k] for k in loops},
              "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"reference MLP, {RANKS} ranks, batch {BATCH}/rank, {args.rounds} rounds in turns (median, min-max):")
    for k in loops:
        print(f"  {k:<17} {result['step_ms'][k]:7.2f} ms")
    for k, v in ratios.items():
        print(f"  {k:<22} {_spread(v)}")


def _loops(args: argparse.Namespace) -> list[str]:
    """`--loops` as a list, checked before anything runs."""
    loops = [k.strip() for k in (args.loops or "").split(",") if k.strip()]
    bad = [k for k in loops if k not in LOOPS]
    if "horovod" in loops and not args.horovod_python:
        bad.append("horovod without --horovod-python")
    if bad or len(loops) < 2 or len(set(loops)) < len(loops):
        why = f"not {', '.join(bad)}" if bad else "each once"
        raise SystemExit(f"--loops {args.loops!r}: name two or more of {', '.join(LOOPS)}, {why}")
    return loops


def _spread(values: list[float]) -> str:
    """The median to three places (a target such as 1.05 must not hide 1.054), the range to two."""
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, help="timed steps per loop and round (default: the long minus the short "
                    "`train` run's steps, so that every loop is timed over as many steps as `train`)")
    ap.add_argument("--long", type=int, default=190, help="steps of the long `train` run (the short one: 40)")
    ap.add_argument("--horovod-python", help="a Python that imports horovod.torch (else Horovod is skipped)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--loops", help="run only these loops, comma-separated (limit, train, train_zero1, handwritten, api, ddp, "
                    "horovod), in turns, and print their ratios to the first")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "allreduce":
        allreduce_worker(args.steps)
        return
    if args.worker:
        worker(args.worker, args.steps)
        return
    args.steps = args.steps or args.long - 40
    if args.loops:
        _loops(args)  # a bad list fails now, not after the data is written
    kinds = ["plain", "handwritten", "api", "ddp"] + (["horovod"] if args.horovod_python else [])
    rows: dict[str, list[float]] = {k: [] for k in ["limit", "limit_of_medians", "limit_back_to_back",
                                                    "limit_in_lockstep", "plain", "lockstep",
                                                    "raw_allreduce", "raw_allreduce_back_to_back", "train",
                                                    "train_loop", "train_zero1", *kinds[1:]]}
    with tempfile.TemporaryDirectory() as tmp:
        data = _shard(Path(tmp))
        def limit(lockstep: bool = False) -> None:
            got = _mpirun(sys.executable, "plain", args.steps)
            rows["plain"].append(got["step_ms"])
            # `train` on CPUs does not overlap communication with backward (`auto_overlap`): the allreduce adds
            # to the step, whatever the cores
            ar = _mpirun(sys.executable, "allreduce", min(args.steps, 100))
            rows["raw_allreduce"].append(ar["raw_allreduce_ms"])
            rows["raw_allreduce_back_to_back"].append(got["raw_allreduce_back_to_back_ms"])
            rows["limit_back_to_back"].append(got["step_ms"] + got["raw_allreduce_back_to_back_ms"])
            rows["limit"].append(got["step_ms"] + ar["raw_allreduce_ms"])
            rows["limit_of_medians"].append(got["median_step_ms"] + ar["median_raw_allreduce_ms"])
            if lockstep:  # full rounds only: `--loops` prints only the loops it names
                rows["lockstep"].append(_mpirun(sys.executable, "lockstep", args.steps)["step_ms"])
                rows["limit_in_lockstep"].append(rows["lockstep"][-1] + ar["raw_allreduce_ms"])

        def train(r: int, kind: str = "train") -> None:
            extra = ("--zero", "1") if kind == "train_zero1" else ()
            wall_ms, loop_ms = _train_step_ms(data, Path(tmp) / f"{kind}{r}", args.long, extra)
            rows[kind].append(wall_ms)
            if kind == "train":
                rows["train_loop"].append(loop_ms)

        if args.loops:
            _some_loops(args, _loops(args), rows, limit, train)
            return
        for r in range(args.rounds):
            # the limit and `train` side by side, in turns first (the machine's speed drifts over minutes here:
            # with the other loops between them, one round's ratio ranged 0.96-1.11 in a run whose medians were
            # 1.05 apart), then the other loops
            if r % 2 == 0:
                limit(lockstep=True)
                train(r)
            else:
                train(r)
                limit(lockstep=True)
            train(r, "train_zero1")
            for kind in kinds[1:]:
                got = _mpirun(args.horovod_python if kind == "horovod" else sys.executable, kind, args.steps)
                rows[kind].append(got["step_ms"])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()),
                  file=sys.stderr, flush=True)
    result: dict[str, object] = {"rounds": args.rounds, "step_ms": {k: statistics.median(v) for k, v in rows.items()},
                                 "per_round_ms": rows}
    ratios = {f"{k}_over_limit": [a / b for a, b in zip(rows[k], rows["limit"])] for k in ("train", "train_loop", "train_zero1", "api", "handwritten")}
    ratios["train_over_limit_of_medians"] = [a / b for a, b in zip(rows["train"], rows["limit_of_medians"])]
    ratios["train_over_limit_back_to_back"] = [a / b for a, b in zip(rows["train"], rows["limit_back_to_back"])]
    ratios["train_over_limit_in_lockstep"] = [a / b for a, b in zip(rows["train"], rows["limit_in_lockstep"])]
    ratios["lockstep_over_plain"] = [a / b for a, b in zip(rows["lockstep"], rows["plain"])]
    ratios["train_over_handwritten"] = [a / b for a, b in zip(rows["train"], rows["handwritten"])]
    for k in ("ddp", "horovod"):
        if rows.get(k):
            ratios[f"{k}_over_train"] = [a / b for a, b in zip(rows[k], rows["train"])]
    result["ratios"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}
    # the same ratios of the loops' medians over the rounds (each loop's noise taken out before dividing)
    medians = {k: statistics.median(v) for k, v in rows.items() if v}
    result["ratios_of_medians"] = {f"{k}_over_limit": medians[k] / medians["limit"] for k in ("train", "train_loop", "train_zero1", "api")}
    if args.json:
        print(json.dumps(result))
        return
    med = result["step_ms"]
    print(f"reference MLP, {RANKS} ranks, batch {BATCH}/rank, {args.rounds} alternating rounds (median, min-max):")
    print(f"  limit             {med['limit']:7.2f} ms  (plain torch {med['plain']:.2f} + raw allreduce in the step "
          f"{med['raw_allreduce']:.2f}: mean steps; of their medians {med['limit_of_medians']:.2f}; with the "
          f"allreduce back to back, {med['raw_allreduce_back_to_back']:.2f} ms: {med['limit_back_to_back']:.2f})")
    print(f"  limit_in_lockstep {med['limit_in_lockstep']:7.2f} ms  (plain torch with a barrier a step "
          f"{med['lockstep']:.2f} + the same allreduce: not the limit, what a synchronous step cannot beat)")
    for k in ("handwritten", "train", "train_loop", "train_zero1", "api", "ddp", "horovod"):
        if rows.get(k):
            print(f"  {k:<17} {med[k]:7.2f} ms")
    for k, v in ratios.items():
        print(f"  {k:<22} {_spread(v)}")
    print("  ratios of the medians: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ratios_of_medians"].items()))


if __name__ == "__main__":
    main()
