#!/usr/bin/env python3
"""Sharding a large HDF5 source (issue: data at supercomputer scale).

Writes a ~2.4 GB HDF5 source (784 float32 features per sample, written in chunks), then times, alternating,
  1. a plain chunked h5py copy of the same bytes into 4 files (the baseline; also with fletcher32, the
     per-chunk checksum every shard dataset carries),
  2. `hpctrain shard SRC OUT --shards 4 --val-fraction 0` (split, fletcher32, sha256, manifest),
  3. the same copy with an fsync of each file, and
  4. `hpctrain shard ... --fsync` (every file durable before OUT is renamed into place),
and reports the wall-time ratios 2/1 (target <= 2x) and 4/3, and the shard command's peak RSS, its worker
processes included (target < 1 GiB).

    python benchmarks/shard_scale.py [--gb 2.4] [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

FEATURES = 784


def make_source(path: Path, rows: int) -> None:
    with h5py.File(path, "w") as h5:
        x = h5.create_dataset("x", (rows, FEATURES), np.float32, chunks=(1024, FEATURES))
        y = h5.create_dataset("y", (rows,), np.int64, chunks=(65536,))
        rng = np.random.default_rng(0)
        step = 65536
        for s in range(0, rows, step):
            e = min(rows, s + step)
            x[s:e] = rng.standard_normal((e - s, FEATURES), dtype=np.float32)
            y[s:e] = rng.integers(0, 10, e - s)


def plain_copy(src: Path, out: Path, parts: int = 4, durable: bool = False, fletcher32: bool = False) -> float:
    out.mkdir()
    t0 = time.perf_counter()
    with h5py.File(src, "r") as h5:
        rows = h5["x"].shape[0]
        bounds = np.linspace(0, rows, parts + 1).astype(int)
        step = 65536
        for k in range(parts):
            lo, hi = bounds[k], bounds[k + 1]
            with h5py.File(out / f"part-{k}.h5", "w") as o:
                ox = o.create_dataset("x", (hi - lo, FEATURES), np.float32, chunks=(334, FEATURES), fletcher32=fletcher32)
                oy = o.create_dataset("y", (hi - lo,), np.int64, chunks=(4096,), fletcher32=fletcher32)
                for s in range(lo, hi, step):
                    e = min(hi, s + step)
                    ox[s - lo:e - lo] = h5["x"][s:e]
                    oy[s - lo:e - lo] = h5["y"][s:e]
            if durable:  # what `hpctrain shard` does before it renames OUT into place
                with open(out / f"part-{k}.h5", "rb") as fh:
                    os.fsync(fh.fileno())
    return time.perf_counter() - t0


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, now (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return total


def hpctrain_shard(src: Path, out: Path, durable: bool = False) -> tuple[float, int]:
    """Wall time and peak resident memory of the whole command: the process and its writer workers together
    (sampled every 10 ms)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "shard", str(src), str(out), "--shards", "4",
                             "--val-fraction", "0", "--json", *(["--fsync"] if durable else [])],
                            stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit("hpctrain shard failed")
    return wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.4)
    ap.add_argument("--dir", default=None, help="where to put the ~3x GB of temporary files")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = int(args.gb * 1e9 / (FEATURES * 4))
    tmp = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        src = tmp / "source.h5"
        make_source(src, rows)
        os.sync()
        copies, durable, shards, dshards, rss, checked = [], [], [], [], [], []
        for i in range(args.repeats):  # alternate; report the best of each
            copies.append(plain_copy(src, tmp / f"copy{i}"))
            shutil.rmtree(tmp / f"copy{i}")
            checked.append(plain_copy(src, tmp / f"fcopy{i}", fletcher32=True))
            shutil.rmtree(tmp / f"fcopy{i}")
            wall, peak = hpctrain_shard(src, tmp / f"shards{i}")
            shards.append(wall)
            rss.append(peak)
            shutil.rmtree(tmp / f"shards{i}")
            os.sync()  # each pair starts with no dirty pages left by the one before
            durable.append(plain_copy(src, tmp / f"dcopy{i}", durable=True))
            shutil.rmtree(tmp / f"dcopy{i}")
            wall, peak = hpctrain_shard(src, tmp / f"dshards{i}", durable=True)
            dshards.append(wall)
            rss.append(peak)
            shutil.rmtree(tmp / f"dshards{i}")
            os.sync()
        result = {"source_gb": src.stat().st_size / 1e9, "rows": rows, "plain_copy_s": min(copies),
                  "hpctrain_shard_s": min(shards), "ratio": min(shards) / min(copies),
                  "median_ratio": statistics.median(shards) / statistics.median(copies),
                  "plain_copy_fletcher32_s": min(checked), "ratio_vs_fletcher32_copy": min(shards) / min(checked),
                  "plain_copy_fsync_s": min(durable), "hpctrain_shard_fsync_s": min(dshards),
                  "ratio_fsync": min(dshards) / min(durable), "peak_rss_mib": max(rss) / 2**20,
                  "all_copy_s": copies, "all_copy_fletcher32_s": checked, "all_shard_s": shards, "all_copy_fsync_s": durable,
                  "all_shard_fsync_s": dshards}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"source {result['source_gb']:.2f} GB ({rows} x {FEATURES} float32)")
        print(f"plain chunked h5py copy into 4 files: {result['plain_copy_s']:.1f} s; hpctrain shard --shards 4: "
              f"{result['hpctrain_shard_s']:.1f} s ({result['ratio']:.2f}x; medians {result['median_ratio']:.2f}x)")
        print(f"the copy with fletcher32 on both datasets: {result['plain_copy_fletcher32_s']:.1f} s "
              f"(shard / it = {result['ratio_vs_fletcher32_copy']:.2f}x)")
        print(f"the same, each file fsynced:          {result['plain_copy_fsync_s']:.1f} s; hpctrain shard --fsync: "
              f"{result['hpctrain_shard_fsync_s']:.1f} s ({result['ratio_fsync']:.2f}x)")
        print(f"peak RSS of hpctrain shard with its workers: {result['peak_rss_mib']:.0f} MiB (best of {args.repeats} each)")

if __name__ == "__main__":
    main()
