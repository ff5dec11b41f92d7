#!/usr/bin/env python3
"""Gradient compression on digits (issue 18): bytes on the wire and accuracy beside no compression.

Shards digits (2 shards), then trains `--model mlp:512,512` for 20 epochs on 2 ranks with each
--grad-compression in turn (none, powersgd:4, topk:0.01; add more with --wire), the same seed and data, and
reports each run's `wire_bytes_per_step` (the gradient payload one rank contributes per step) over none's,
and its val_accuracy minus none's. Targets: powersgd:4 sends <= 1/20 of the bytes with val_accuracy within
1 point; topk:0.01 within 2 points. Runs in a temporary directory, removed at the end.

    python benchmarks/compression.py [--epochs 20] [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = {"powersgd:4": (1 / 20, 0.01), "topk:0.01": (None, 0.02)}


def hpctrain(args: list[str]) -> str:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"hpctrain {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="seeds per wire format (accuracy: the mean)")
    parser.add_argument("--wire", action="append", default=[], help="more --grad-compression values")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    wires = ["none", "powersgd:4", "topk:0.01", *opts.wire]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits"
        hpctrain(["shard", "digits", str(data), "--shards", "2"])
        for wire in wires:
            accs, wire_bytes, times = [], 0, []
            for seed in range(opts.repeats):
                run = Path(tmp) / f"{wire}-{seed}"
                out = hpctrain(["launch", "-n", "2", "--", "train", "--data", str(data), "--run-dir", str(run),
                                "--model", "mlp:512,512", "--epochs", str(opts.epochs), "--seed", str(seed),
                                "--grad-compression", wire, "--json"])
                s = json.loads(out.strip().splitlines()[-1])
                assert s["ranks_in_sync"], wire
                accs.append(s["val_accuracy"])
                wire_bytes = s["wire_bytes_per_step"]
                times.append(s["train_time_s"])
            rows[wire] = {"val_accuracy": statistics.mean(accs), "accuracies": accs, "wire_bytes_per_step": wire_bytes,
                          "train_time_s": statistics.median(times)}
    base = rows["none"]
    for wire, row in rows.items():
        row["bytes_over_none"] = row["wire_bytes_per_step"] / base["wire_bytes_per_step"]
        row["accuracy_minus_none"] = row["val_accuracy"] - base["val_accuracy"]
        bytes_max, acc_max = TARGETS.get(wire, (None, None))
        row["meets_target"] = ((bytes_max is None or row["bytes_over_none"] <= bytes_max)
                               and (acc_max is None or row["accuracy_minus_none"] >= -acc_max)) if wire in TARGETS else None
    if opts.json:
        print(json.dumps({"epochs": opts.epochs, "repeats": opts.repeats, "runs": rows}))
        return
    print(f"digits, mlp:512,512, {opts.epochs} epochs, 2 ranks, {opts.repeats} seed(s)")
    print(f"{'wire':>12} {'bytes/step':>11} {'x none':>8} {'val_acc':>8} {'- none':>7} {'train s':>8}  target")
    for wire, r in rows.items():
        print(f"{wire:>12} {r['wire_bytes_per_step']:>11,} {r['bytes_over_none']:>8.4f} {r['val_accuracy']:>8.4f} "
              f"{r['accuracy_minus_none']:>+7.4f} {r['train_time_s']:>8.1f}  "
              f"{'' if r['meets_target'] is None else ('met' if r['meets_target'] else 'MISSED')}")


if __name__ == "__main__":
    main()
