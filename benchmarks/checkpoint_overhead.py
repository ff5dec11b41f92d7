#!/usr/bin/env python3
"""Checkpoint cost on the reference workload (issue: checkpoint/restart).

Reference: MLP 784-2048-2048-10, batch 64 per rank, 2 ranks, SGD with momentum. Runs the same training
with `--checkpoint-every 0` and `--checkpoint-every 50`, alternating (A B A B ...) to spread machine noise
over both, and reports:
  - overhead: median train time with checkpoints / without - 1 (target <= 5%)
  - stall: median time a step waits at a periodic (asynchronous) checkpoint (gather + host snapshot), beside a plain
    torch.save of the same state (model + optimizer) to memory (target <= 1.2x)

    python benchmarks/checkpoint_overhead.py [--steps 300] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(data: Path, run_dir: Path, every: int, steps: int, optimizer: str = "sgd") -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(
        [sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data), "--run-dir",
         str(run_dir), "--model", "mlp:2048,2048", "--batch-size", "64", "--max-steps", str(steps), "--epochs", "100",
         "--optimizer", optimizer, "--lr", "0.01" if optimizer == "sgd" else "0.001", "--checkpoint-every", str(every), "--resume", "never", "--json",
         "--log-every", "50"],
        check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_save_ms(optimizer: str = "sgd") -> float:
    import torch

    from hpctrain.compute.models import build_model

    torch.set_num_threads(1)
    model = build_model("mlp:2048,2048", (784,), 10)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.001))
    model(torch.randn(4, 784)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        torch.save(state, io.BytesIO())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                    help="sgd (momentum: 46 MB of state) or adam (70 MB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "synthetic:9600:784:10", str(data), "--shards", "2",
                        "--val-fraction", "0"], check=True, capture_output=True)
        plain, ckpt, stalls, writes = [], [], [], []
        for i in range(args.repeats):
            plain.append(run(data, Path(tmp) / f"a{i}", 0, args.steps, args.optimizer)["train_time_s"])
            s = run(data, Path(tmp) / f"b{i}", 50, args.steps, args.optimizer)
            ckpt.append(s["train_time_s"])
            stalls.append(s["checkpoint"]["async_stall_median_s"] * 1e3)
            writes.append(s["checkpoint"]["write_cpu_s"] / s["checkpoint"]["saves"] * 1e3)
    save_ms = torch_save_ms(args.optimizer)
    result = {
        "steps": args.steps, "repeats": args.repeats, "optimizer": args.optimizer,
        "train_s_no_checkpoints": statistics.median(plain), "train_s_every_50": statistics.median(ckpt),
        "overhead": statistics.median(ckpt) / statistics.median(plain) - 1,
        "stall_ms": statistics.median(stalls), "background_write_cpu_ms": statistics.median(writes),
        "torch_save_to_memory_ms": save_ms,
        "stall_over_torch_save": statistics.median(stalls) / save_ms,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"train time, no periodic checkpoints: {result['train_s_no_checkpoints']:.2f} s (median of {args.repeats})")
        print(f"train time, every 50 steps:          {result['train_s_every_50']:.2f} s  -> overhead {100 * result['overhead']:.1f}%")
        print(f"stall per checkpoint: {result['stall_ms']:.1f} ms; torch.save of the same state to memory: "
              f"{save_ms:.1f} ms ({result['stall_over_torch_save']:.2f}x)")
        print(f"CPU time of the background write per checkpoint: {result['background_write_cpu_ms']:.1f} ms")


if __name__ == "__main__":
    main()
