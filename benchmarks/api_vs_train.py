#!/usr/bin/env python3
"""A custom loop through the library API vs `hpctrain train`, same reference workload (issue: library API).

MLP 784-2048-2048-10, batch 64 per rank, 2 ranks, SGD momentum, synthetic 784-feature shards. Both runs
report the median step time (forward + backward + gradient sync + optimizer step, data excluded); the
target is the API loop within 5% of `hpctrain train`. Runs alternate (train, api, train, api, ...).

    python benchmarks/api_vs_train.py [--steps 150] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def worker(data: str, steps: int, scaled: bool) -> None:
    """The custom loop, as a user would write it with the API."""
    import torch

    import hpctrain
    from hpctrain.compute.models import build_model

    ctx = hpctrain.init()
    torch.manual_seed(0)
    model = build_model("mlp:2048,2048", (784,), 10)
    hpctrain.broadcast_parameters(model)
    loader = hpctrain.ShardLoader(data, batch_size=64)
    opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, done = [], 0
    while done < steps:
        for x, y in loader:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            (opt.scale_loss(loss) if scaled else loss).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            done += 1
            if done >= steps:
                break
    med = ctx.comm.allreduce_array([statistics.median(times[10:])], op="max")[0]
    if ctx.rank == 0:
        print(json.dumps({"step_ms": med * 1e3}))


def train_step_ms(data: Path, run: Path, steps: int) -> float:
    subprocess.run([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data),
                    "--run-dir", str(run), "--model", "mlp:2048,2048", "--batch-size", "64", "--max-steps", str(steps),
                    "--epochs", "100", "--lr", "0.01", "--checkpoint-every", "0", "--resume", "never", "--log-every", "10",
                    "--json"], check=True, capture_output=True, env=ENV)
    times = []
    for line in (run / "metrics.jsonl").read_text().splitlines()[1:]:  # skip the warm-up window
        rec = json.loads(line)
        times.append(rec["step_ms"])
    return statistics.median(times)


def api_step_ms(data: Path, steps: int, scaled: bool) -> float:
    out = subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, __file__, "--worker", str(data),
                          "--steps", str(steps), *(["--scaled"] if scaled else [])], check=True, capture_output=True,
                         text=True, env=ENV).stdout
    return json.loads(out.strip().splitlines()[-1])["step_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--scaled", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.scaled)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "synthetic:9600:784:10", str(data), "--shards", "2",
                        "--val-fraction", "0"], check=True, capture_output=True)
        train, api, plain = [], [], []
        for i in range(args.repeats):
            train.append(train_step_ms(data, Path(tmp) / f"r{i}", args.steps))
            api.append(api_step_ms(data, args.steps, scaled=True))
            plain.append(api_step_ms(data, args.steps, scaled=False))
    result = {"train_step_ms": statistics.median(train), "api_step_ms": statistics.median(api),
              "api_unscaled_step_ms": statistics.median(plain)}
    result["api_over_train"] = result["api_step_ms"] / result["train_step_ms"]
    result["api_unscaled_over_train"] = result["api_unscaled_step_ms"] / result["train_step_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"hpctrain train step: {result['train_step_ms']:.2f} ms; API loop with opt.scale_loss: "
              f"{result['api_step_ms']:.2f} ms ({result['api_over_train']:.3f}x); plain loss.backward(): "
              f"{result['api_unscaled_step_ms']:.2f} ms ({result['api_unscaled_over_train']:.3f}x)")


if __name__ == "__main__":
    main()
