"""Model-parallel layouts against pure data parallelism: the same tiny GPT trained in each layout (D, T, P),
and checkpoints of one layout resumed in others (issue #30's numbers).

    python benchmarks/parallel_equivalence.py [--steps 8] [--optimizer sgd] [--keep DIR]

Token rows of a standard-library file (bisect.py: 195 rows of 16 + 1 byte tokens, 2 shards), a 4-layer GPT
(dim 32, 2 heads, the 257 byte ids split unevenly over T = 2), fp32, --no-shuffle, batch 8 per data-parallel
rank. Prints the largest |parameter difference| of each layout's final model against (2,1,1) or (1,1,1),
then: saved at (2,2,1) after half the steps and resumed at (2,1,2), against the uninterrupted (2,2,1) run;
saved at (2,2,1) and resumed at (1,1,4) to the end of the epoch, with how often each row was trained on
(--audit-samples). Each run is `hpctrain launch -n W -- train ...`; up to 8 ranks share this machine's cores.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path

import torch

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "bisect.py"
LAYOUTS = {(2, 1, 1): None, (2, 2, 1): (2, 1, 1), (2, 1, 2): (2, 1, 1), (2, 2, 2): (2, 1, 1),
           (1, 1, 1): None, (1, 2, 2): (1, 1, 1), (1, 1, 4): (1, 1, 1)}


def hpctrain(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"hpctrain {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")


def train(data: Path, run: Path, layout: tuple[int, int, int], steps: int, optimizer: str, *extra: str) -> None:
    d, t, p = layout
    hpctrain("launch", "-n", str(d * t * p), "--", "train", "--data", str(data), "--run-dir", str(run),
             "--model", "gpt:layers=4,dim=32,heads=2", "--batch-size", "8", "--no-shuffle", "--optimizer", optimizer,
             "--lr", "0.05" if optimizer == "sgd" else "0.01", "--checkpoint-every", "0", "--tp", str(t), "--pp", str(p),
             *(("--max-steps", str(steps)) if steps else ()), *extra)


def gap(a: Path, b: Path) -> float:
    wa, wb = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    parser.add_argument("--keep", type=Path, help="keep the runs in this directory")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="hpctrain-layouts-"))
    data = root / "tokens"
    if not data.exists():
        hpctrain("shard", f"text:{TEXT}", str(data), "--seq-len", "16", "--shards", "2", "--val-fraction", "0")
    name = "-".join
    for layout in LAYOUTS:
        train(data, root / name(map(str, layout)), layout, args.steps, args.optimizer)
    print(f"{args.steps} steps, {args.optimizer}, fp32: max |parameter difference| against pure data parallelism")
    for layout, ref in LAYOUTS.items():
        if ref is not None:
            print(f"  {layout} vs {ref}: {gap(root / name(map(str, layout)), root / name(map(str, ref))):.2e}")
    half = args.steps // 2
    train(data, root / "saved", (2, 2, 1), half, args.optimizer, "--audit-samples")
    shutil.copytree(root / "saved", root / "elastic")
    train(data, root / "saved", (2, 1, 2), args.steps, args.optimizer, "--audit-samples")
    print(f"saved at (2,2,1) step {half}, resumed at (2,1,2) to step {args.steps}, vs the uninterrupted (2,2,1): "
          f"{gap(root / 'saved', root / '2-2-1'):.2e}")
    train(data, root / "elastic", (1, 1, 4), 0, args.optimizer, "--epochs", "1", "--audit-samples")
    seen: Counter = Counter()
    for path in (root / "elastic" / "samples").glob("rank-*.txt"):
        words = path.read_text().split()
        seen.update(zip(words[::2], words[1::2]))
    print(f"saved at (2,2,1) step {half}, resumed at (1,1,4) to the end of the epoch: {len(seen)} rows trained on, "
          f"each {'once' if set(seen.values()) == {1} else f'{min(seen.values())}-{max(seen.values())} times'}")
    if args.keep is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
