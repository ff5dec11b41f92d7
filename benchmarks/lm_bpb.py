#!/usr/bin/env python3
"""Bits per byte of a small GPT on real source code within 10 minutes, against the text's unigram byte entropy.

The target: 2 ranks, a 2-layer GPT (dim 128, 4 heads, sequence 128, bytes tokenizer) on a few MB of real
source code that nobody wrote for the test reaches validation bits per byte <= 0.75x the unigram byte entropy
of the same text, the whole training command within 10 minutes on this machine.

The text is this Python's standard library, its top-level modules (`sysconfig.get_paths()['stdlib']`, glob
`*.py`: about 4.7 MB in 168 files on CPython 3.11), one document per file. The script
  1. shards it (`hpctrain shard text:DIR --glob '*.py' --seq-len 128 --shards 2 --val-fraction 0.05`) into a
     temporary directory;
  2. computes the unigram byte entropy H = -sum p(b) log2 p(b) of the validation documents (the split rule
     replayed with `hpctrain.data.text.split_documents`, checked against the manifest's val `text_bytes`) and
     of all the text: the bits per byte of the best model that ignores context;
  3. times a short calibration run (`--calibrate-steps`, same options) for the step time and the fixed cost
     (start-up, peak-FLOP/s measurement, final validation);
  4. plans the steps that fit `--plan-s` seconds (default 480 of the 600 allowed, room for a shared machine),
     rounded down to whole epochs once there is more than one: `train` validates at every epoch's end and, on
     reaching --max-steps mid-epoch after one, reports that earlier validation, not the final model's;
  5. runs `hpctrain launch -n 2 -- train --model gpt:layers=2,dim=128,heads=4 --optimizer adamw --schedule
     cosine --max-steps N --epochs 1000`, timing the whole command (launch to exit) as wall_s, and reads
     val_bits_per_byte, tokens_per_s and mfu from summary.json; the step of the validation it reports is
     checked against metrics.jsonl.

Prints a table and, with --json, one JSON object. The shards and the run are removed at the end unless --keep.

    python benchmarks/lm_bpb.py [--lr 3e-3] [--batch-size 32] [--plan-s 480] [--steps N] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any
from pathlib import Path

import numpy as np

RANKS = 2
MODEL = "gpt:layers=2,dim=128,heads=4"
SEQ_LEN = 128
SHARDS = 2
VAL_FRACTION = 0.05
GLOB = "*.py"
BUDGET_S = 600.0  # the target's limit on the training command


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def run_cli(args: list[str], log: Path) -> float:
    """`python -m hpctrain ARGS` with its output in `log`; its wall seconds. Exits with the log's tail on failure."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], stdout=fh, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"hpctrain {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return wall


def shard(text_dir: Path, out: Path, logs: Path) -> dict:
    """The shards of the text; returns the manifest."""
    run_cli(["shard", f"text:{text_dir}", str(out), "--glob", GLOB, "--seq-len", str(SEQ_LEN), "--shards",
             str(SHARDS), "--val-fraction", str(VAL_FRACTION)], logs / "shard.log")
    return json.loads((out / "manifest.json").read_text())


def entropy_bits(counts: np.ndarray) -> float:
    """Unigram entropy in bits of a histogram of byte values."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def text_entropies(text_dir: Path) -> dict[str, float]:
    """Unigram byte entropy and size of the val documents and of all documents, split as `shard` splits them."""
    from hpctrain.data.text import open_documents, split_documents

    counts = {"val": np.zeros(256, np.int64), "all": np.zeros(256, np.int64)}
    for split, doc in split_documents(open_documents(f"text:{text_dir}", glob=GLOB), VAL_FRACTION):
        for piece in doc:
            c = np.bincount(np.frombuffer(piece, np.uint8), minlength=256)
            counts["all"] += c
            if split == "val":
                counts["val"] += c
    return {"val_entropy_bits": entropy_bits(counts["val"]), "all_entropy_bits": entropy_bits(counts["all"]),
            "val_text_bytes": int(counts["val"].sum()), "all_text_bytes": int(counts["all"].sum())}


def train(data: Path, run_dir: Path, steps: int, args: argparse.Namespace, *, log_every: int = 50,
          precision: str = "fp32", extra: list[str] | None = None) -> tuple[float, dict]:
    """One `hpctrain launch -n 2 -- train` of the GPT; its wall seconds and summary.json."""
    cmd = ["launch", "-n", str(RANKS), "--", "train", "--data", str(data), "--run-dir", str(run_dir), "--model", MODEL,
           "--optimizer", "adamw", "--lr", str(args.lr), "--batch-size", str(args.batch_size), "--schedule",
           args.schedule, "--weight-decay", str(args.weight_decay), "--clip-grad", str(args.clip_grad),
           "--warmup", str(getattr(args, "warmup", 0)),
           "--max-steps", str(steps), "--epochs", "1000", "--precision", precision, "--seed", str(args.seed),
           "--log-every", str(log_every), "--checkpoint-every", "0", "--json", *(extra or [])]
    wall = run_cli(cmd, run_dir.parent / f"{run_dir.name}.log")
    return wall, json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def steps_per_epoch(manifest: dict, batch_size: int) -> int:
    """`ShardReader.steps_per_epoch` for RANKS ranks: the most batches any rank's shards need."""
    shards = manifest["splits"]["train"]["shards"]
    per_rank = [sum(s["samples"] for s in shards[r::RANKS]) for r in range(RANKS)]
    return -(-max(per_rank) // batch_size)


def plan(calibration: dict, per_epoch: int, manifest: dict, args: argparse.Namespace) -> int:
    """The steps that fit args.plan_s after the fixed cost, whole epochs once more than one fits; each epoch
    end adds a validation pass (estimated at a third of a training step per row: forward only)."""
    step_s, fixed_s = calibration["step_s"], calibration["fixed_s"]
    val_rows = manifest["splits"]["val"]["samples"] / RANKS
    val_s = val_rows / args.batch_size * step_s / 3
    steps = int((args.plan_s - fixed_s) / step_s)
    if steps <= per_epoch:
        return max(1, steps)
    epochs = int((args.plan_s - fixed_s) // (per_epoch * step_s + val_s))
    return max(1, epochs) * per_epoch


def calibrate(data: Path, work: Path, args: argparse.Namespace) -> dict:
    """Step time (median over logged windows after the first) and the rest of the command's wall time."""
    n = args.calibrate_steps
    wall, _ = train(data, work / "calibration", n, args, log_every=max(1, n // 5))
    windows = [m["step_ms"] / 1e3 for m in metrics(work / "calibration") if "step_ms" in m][1:]
    step_s = float(np.median(windows))
    return {"steps": n, "wall_s": wall, "step_s": step_s, "fixed_s": max(0.0, wall - n * step_s)}


def measure(args: argparse.Namespace, work: Path) -> dict:
    text_dir = stdlib_dir()
    manifest = shard(text_dir, work / "data", work)
    ent = text_entropies(text_dir)
    if ent["val_text_bytes"] != manifest["splits"]["val"]["text_bytes"]:
        raise SystemExit(f"the replayed val split has {ent['val_text_bytes']} bytes, the manifest "
                         f"{manifest['splits']['val']['text_bytes']}: the split rule changed")
    per_epoch = steps_per_epoch(manifest, args.batch_size)
    cal = None
    steps = args.steps
    if not steps:
        cal = calibrate(work / "data", work, args)
        steps = plan(cal, per_epoch, manifest, args)
        print(f"calibration: {cal['step_s'] * 1e3:.0f} ms/step, {cal['fixed_s']:.0f} s fixed; planned {steps} steps "
              f"({steps / per_epoch:.2f} epochs of {per_epoch})", file=sys.stderr, flush=True)
    wall, summ = train(work / "data", work / "run", steps, args)
    vals = [m for m in metrics(work / "run") if "val_loss" in m]
    val_step = vals[-1]["step"] if vals and vals[-1]["val_loss"] == summ["val_loss"] else summ["steps"]
    bpb = summ["val_bits_per_byte"]
    return {
        "text": f"{text_dir}/{GLOB}", "documents": manifest["splits"]["train"]["documents"]
        + manifest["splits"]["val"]["documents"], **ent, "model": MODEL, "ranks": RANKS, "seq_len": SEQ_LEN,
        "batch_size": args.batch_size, "lr": args.lr, "schedule": args.schedule, "weight_decay": args.weight_decay,
        "clip_grad": args.clip_grad, "steps": summ["steps"], "epochs": summ["steps"] / per_epoch,
        "train_tokens": summ["steps"] * args.batch_size * RANKS * SEQ_LEN, "wall_s": wall,
        "train_time_s": summ["train_time_s"], "val_step": val_step, "val_loss": summ["val_loss"],
        "val_bits_per_byte": bpb, "ratio": bpb / ent["val_entropy_bits"],
        "ratio_all_text": bpb / ent["all_entropy_bits"], "tokens_per_s": summ["tokens_per_s"], "mfu": summ["mfu"],
        "peak_flops": summ["peak_flops"], "flops_per_token": summ["flops_per_token"], "calibration": cal,
        "pass": bool(bpb <= 0.75 * ent["val_entropy_bits"] and wall <= BUDGET_S and val_step == summ["steps"]),
    }


def table(r: dict) -> str:
    rows = [
        ("text", f"{r['text']} ({r['documents']} files, {r['all_text_bytes'] / 1e6:.2f} MB; val "
                 f"{r['val_text_bytes'] / 1e6:.3f} MB)"),
        ("run", f"{r['ranks']} ranks, {r['model']}, seq {r['seq_len']}, batch {r['batch_size']}/rank, adamw lr "
                f"{r['lr']:g} {r['schedule']}, wd {r['weight_decay']:g}, clip {r['clip_grad']:g}"),
        ("steps", f"{r['steps']} ({r['epochs']:.2f} epochs, {r['train_tokens'] / 1e6:.1f} M tokens); validated at "
                  f"step {r['val_step']}"),
        ("wall_s", f"{r['wall_s']:.0f} s for the training command (train loop {r['train_time_s']:.0f} s; limit "
                   f"{BUDGET_S:.0f} s)"),
        ("val bits/byte", f"{r['val_bits_per_byte']:.3f} (val loss {r['val_loss']:.3f} nats/token)"),
        ("unigram entropy", f"{r['val_entropy_bits']:.3f} bits/byte val text, {r['all_entropy_bits']:.3f} all text"),
        ("ratio", f"{r['ratio']:.3f} of the val text's entropy (target <= 0.75; {r['ratio_all_text']:.3f} of "
                  "all text's)"),
        ("tokens/s", f"{r['tokens_per_s']:.0f}"),
        ("mfu", f"{r['mfu']:.3f} ({r['flops_per_token'] / 1e6:.2f} MFLOP/token, peak {r['peak_flops'] / 1e9:.0f} "
                "GFLOP/s over both ranks, measured)"),
        ("result", "PASS" if r["pass"] else "FAIL"),
    ]
    return "\n".join(f"{k:>16}  {v}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of adamw (default 2e-3)")
    ap.add_argument("--batch-size", type=int, default=32, help="rows per rank per step (default 32)")
    ap.add_argument("--schedule", default="cosine", help="constant, cosine or step (default cosine)")
    training_options(ap)
    ap.add_argument("--plan-s", type=float, default=480.0, help="seconds the training command is planned to take")
    ap.add_argument("--calibrate-steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=0, help="train this many steps, no calibration (0: plan)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the shards and the runs (printed)")
    run_in_temp(ap.parse_args(), "hpctrain-lm-bpb-", measure, table)


def training_options(ap: argparse.ArgumentParser, *, warmup: int = 0) -> None:
    """The training flags both LM benchmarks take (weight decay, clipping, warmup, seed)."""
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=warmup, help=f"steps of linear learning-rate warmup (default {warmup})")
    ap.add_argument("--seed", type=int, default=0)


def run_in_temp(args: argparse.Namespace, prefix: str, measure_fn: Any, table_fn: Any) -> None:
    """measure_fn(args, work) in a temporary directory (kept with --keep), then print JSON or the table."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        result = measure_fn(args, work)
    finally:
        if args.keep:
            print(f"kept the shards and runs in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result) if args.json else table_fn(result))


if __name__ == "__main__":
    main()
