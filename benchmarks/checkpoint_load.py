#!/usr/bin/env python3
"""Loading a checkpoint on 2 ranks: rank 0 reads and broadcasts, or every rank reads (issue: checkpoint/restart).

Writes a checkpoint of the reference run (MLP 784-2048-2048-10 with Adam: 70 MB of model and optimizer
state), then under `mpirun -n 2` times, alternating, both ways of loading it, each with the files first
evicted from the page cache (posix_fadvise DONTNEED: a cold read, as after a requeue on another node) and
again warm:
  - bcast:    rank 0 verifies and reads the files, then broadcasts the state (what hpctrain does)
  - per-rank: every rank verifies and reads the files itself
On one node the disk is shared, so this measures the read and broadcast costs, not a parallel filesystem;
there, per-rank reading also multiplies the metadata operations (opens, stats) by the number of ranks.

    python benchmarks/checkpoint_load.py [--repeats 3] [--json]
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


def child(path: Path, repeats: int) -> None:
    from hpctrain.checkpoint import manager as ckpt
    from hpctrain.comm import world
    from hpctrain.checkpoint.manager import load_broadcast

    comm = world()

    def evict() -> None:
        for file in path.iterdir():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for cache in ("cold", "warm"):
            for mode in ("bcast", "per-rank"):
                if cache == "cold" and comm.rank == 0:
                    evict()
                comm.barrier()
                t0 = time.perf_counter()
                state = load_broadcast(path, comm) if mode == "bcast" else ckpt.load_files(path)
                comm.barrier()
                times.setdefault(f"{mode} {cache}", []).append(time.perf_counter() - t0)
                assert state["meta"]["parts"] >= 1
    if comm.rank == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child), args.repeats)
        return
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "hpctrain", "shard", "synthetic:2000:784:10", str(data), "--shards", "2",
                        "--val-fraction", "0"], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data),
                        "--run-dir", str(run), "--model", "mlp:2048,2048", "--optimizer", "adam", "--max-steps", "2",
                        "--batch-size", "64", "--json"], check=True, capture_output=True, env=env)
        path = sorted((run / "checkpoints").glob("step-*"))[-1]
        size = sum(f.stat().st_size for f in path.iterdir())
        out = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, __file__, "--child", str(path),
                              "--repeats", str(args.repeats)], check=True, capture_output=True, text=True, env=env)
        result = dict(json.loads(out.stdout.strip().splitlines()[-1]), checkpoint_mb=size / 1e6)
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint: {result['checkpoint_mb']:.0f} MB, 2 ranks, median of {args.repeats}")
    for cache in ("cold", "warm"):
        print(f"  {cache} page cache: rank 0 reads + broadcast {result[f'bcast {cache}'] * 1e3:.0f} ms, "
              f"every rank reads {result[f'per-rank {cache}'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
