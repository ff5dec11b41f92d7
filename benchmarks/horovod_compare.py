#!/usr/bin/env python3
"""Horovod 0.28.1 against `hpctrain.horovod`, the same script on 2 ranks, side by side (issue 27).

Two workloads, each run by both libraries in alternating rounds (so load drifts hit both alike):
- the reference MLP (784-2048-2048-10, batch 64 per rank, SGD momentum 0.9), Horovod's benchmark loop
  (zero_grad, forward, cross entropy, backward, step through `hvd.DistributedOptimizer`): samples/s;
- Horovod's own `examples/pytorch/pytorch_synthetic_benchmark.py` (../shared/peers/horovod) on its small
  ResNet stand-in (`stub/torchvision`: torchvision's wheel does not load here), batch 32: images/s.
Only the import line differs: `import horovod.torch as hvd` or `import hpctrain.horovod as hvd`.
Horovod is built from its PyPI sdist against the same Open MPI (CMAKE_CXX_STANDARD 17 for today's torch);
pass the Python that has it.

    python benchmarks/horovod_compare.py --horovod-python /tmp/hvdenv/bin/python [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT.parent / "shared" / "peers" / "horovod"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
BATCH, FEATURES, CLASSES, WIDTH = 64, 784, 10, 2048


def worker(module: str, steps: int) -> None:
    """One rank of the MLP loop under `module` (horovod.torch or hpctrain.horovod); rank 0 prints samples/s."""
    import importlib

    import torch

    hvd = importlib.import_module(module)
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    hvd.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = max(hvd.allgather_object(time.perf_counter() - t0))
    if hvd.rank() == 0:
        print(json.dumps({"samples_per_s": steps * BATCH * hvd.size() / elapsed}), flush=True)


def _run(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    proc = subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", *argv], capture_output=True, text=True,
                          timeout=900, env=env, cwd=cwd)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[:3])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _synthetic_copy(tmp: Path) -> dict[str, Path]:
    """Horovod's benchmark script, once per import line."""
    text = (PEER / "pytorch_synthetic_benchmark.py").read_text()
    out = {}
    for module in ("horovod.torch", "hpctrain.horovod"):
        path = tmp / f"synthetic_{module.split('.')[0]}.py"
        path.write_text(text.replace("import horovod.torch as hvd", f"import {module} as hvd"))
        out[module] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--horovod-python", help="a Python that imports horovod.torch (required)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed MLP steps per round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    if not args.horovod_python:
        ap.error("--horovod-python is required: a Python with Horovod 0.28.1 (see the docstring)")
    pythons = {"horovod.torch": args.horovod_python, "hpctrain.horovod": sys.executable}
    rows: dict[str, list[float]] = {f"{w}:{m}": [] for w in ("mlp", "resnet") for m in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        scripts = _synthetic_copy(Path(tmp))
        env = dict(ENV, PYTHONPATH=os.pathsep.join([str(ROOT), str(PEER / "stub")]))
        for r in range(args.rounds):
            for module, python in pythons.items():
                got = json.loads(_run([python, __file__, "--worker", module, "--steps", str(args.steps)],
                                      env).strip().splitlines()[-1])
                rows[f"mlp:{module}"].append(got["samples_per_s"])
                text = _run([python, str(scripts[module]), "--model", "resnet18", "--batch-size", "32",
                             "--num-iters", "5", "--no-cuda"], env)
                rows[f"resnet:{module}"].append(float(re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", text)[1]))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rows.items()),
                  file=sys.stderr, flush=True)
    ratios = {w: [a / b for a, b in zip(rows[f"{w}:hpctrain.horovod"], rows[f"{w}:horovod.torch"])]
              for w in ("mlp", "resnet")}
    result = {"rounds": args.rounds, "median": {k: statistics.median(v) for k, v in rows.items()}, "per_round": rows,
              "hpctrain_over_horovod": {w: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                        for w, v in ratios.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"2 ranks, {args.rounds} alternating rounds (median; hpctrain.horovod / Horovod 0.28.1, min-max):")
    for w, unit in (("mlp", "samples/s"), ("resnet", "img/s")):
        v = ratios[w]
        print(f"  {w:<7} Horovod {statistics.median(rows[f'{w}:horovod.torch']):8.0f} {unit}   hpctrain.horovod "
              f"{statistics.median(rows[f'{w}:hpctrain.horovod']):8.0f} {unit}   ratio {statistics.median(v):.2f} "
              f"({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
