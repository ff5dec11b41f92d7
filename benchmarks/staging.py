#!/usr/bin/env python3
"""Staging each rank's shards to node-local disk (`train --stage-to`) against `cp` of the same files (issue 19).

Writes a dataset of about --gb GB (`hpctrain shard synthetic:N:1024`, 8 shards, 10% validation: float32 noise,
which no filesystem compresses) under --data-dir, then, for a cold page cache (the files evicted first, as on a
node that has not read them yet) and a warm one, alternating, --repeats times:
  - cp:       one `cp --parents` of all the files the 2 ranks read (what a job script does once per node)
  - cp x2:    two `cp` at the same time, one per rank's files (the same parallelism as staging)
  - cp+sha:   `cp` of all the files, then `sha256sum` of the copies (a job script that checks what it copied)
  - staging:  `hpctrain launch -n 2 -- train --stage-to DIR --max-steps 1`: `staging_s` from summary.json (the
              slowest rank's copy and sha256 check of its own files, both ranks at the same time)
and once without --stage-to, to compare param_sha256. Prints a table (medians) and, with --json, one JSON
object. The data is removed at the end unless --keep-data.

    nice -n 10 python benchmarks/staging.py [--gb 2.4] [--data-dir /tmp] [--stage-dir /dev/shm] [--repeats 2]
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

D = 1024
WAYS = ("cp", "cp x2", "cp+sha", "staging")
ROW_BYTES = D * 4 + 16  # float32 x, int64 y and index


def evict(files: list[Path]) -> None:
    """Drop the files from the page cache (written back first, so that their pages can go)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cp_all(data: Path, per_rank: list[list[str]], dest: Path) -> None:
    dest.mkdir(parents=True)
    subprocess.run(["cp", "--parents", *per_rank[0], *per_rank[1], str(dest)], cwd=data, check=True)


def cp_two(data: Path, per_rank: list[list[str]], dest: Path) -> None:
    procs = []
    for rank, rel in enumerate(per_rank):
        (dest / str(rank)).mkdir(parents=True)
        procs.append(subprocess.Popen(["cp", "--parents", *rel, str(dest / str(rank))], cwd=data))
    for proc in procs:
        if proc.wait(timeout=3600):
            raise SystemExit(f"cp exited {proc.returncode}")


def cp_checked(data: Path, per_rank: list[list[str]], dest: Path) -> None:
    cp_all(data, per_rank, dest)
    subprocess.run(["sha256sum", *per_rank[0], *per_rank[1]], cwd=dest, check=True, stdout=subprocess.DEVNULL)


BASELINES = {"cp": cp_all, "cp x2": cp_two, "cp+sha": cp_checked}


def cpu_rates(data: Path, rel: list[str], dest: Path) -> dict[str, float]:
    """GB per CPU-second (what a core does when it is not shared) of sha256 alone (hashlib, in memory), of
    `cp` (its own CPU time) and of staging's copy (read, hash, write) of one rank's files, warm."""
    import hashlib
    import resource

    from hpctrain.data.staging import copy_hashed

    size = sum((data / r).stat().st_size for r in rel)
    block, c0 = bytes(64 << 20), time.process_time()
    digest = hashlib.sha256()
    for _ in range(16):
        digest.update(block)
    sha = 16 * len(block) / (time.process_time() - c0)
    dest.mkdir(parents=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["cp", "--parents", *rel, str(dest)], cwd=data, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cp = size / (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    shutil.rmtree(dest)
    dest.mkdir()
    c0 = time.process_time()
    for i, r in enumerate(rel):
        copy_hashed(data / r, dest / str(i), lambda: False)
    staged = size / (time.process_time() - c0)
    shutil.rmtree(dest)
    return {"sha256": sha / 1e9, "cp": cp / 1e9, "staging copy": staged / 1e9}


def train(data: Path, run: Path, env: dict[str, str], *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data),
                          "--run-dir", str(run), "--max-steps", "1", "--batch-size", "64", "--resume", "never",
                          "--checkpoint-every", "0", "--json", *extra], check=True, capture_output=True, text=True,
                         env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, data: Path, stage: Path, work: Path) -> dict:
    from hpctrain.data.shardformat import load_manifest

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    shardset = load_manifest(data)
    per_rank = [[f.path.relative_to(data.resolve()).as_posix() for split in shardset.splits
                 for f in shardset.rank_shards(split, rank, 2)] for rank in (0, 1)]
    files = [data / rel for rel in per_rank[0] + per_rank[1]]
    size = sum(f.stat().st_size for f in files)
    times: dict[str, list[float]] = {}
    shas = []
    for rep in range(args.repeats):
        for cache in ("cold", "warm"):
            if cache == "warm":
                for f in files:  # read once, so that every way finds the files in the page cache
                    with open(f, "rb") as fh:
                        while fh.read(1 << 24):
                            pass
            # one measurement of each way back to back (the order reversed every other time): a load that comes
            # and goes on a shared machine changes all of them alike, so their ratios are compared pairwise
            for how in WAYS if rep % 2 == 0 else WAYS[::-1]:
                if cache == "cold":
                    evict(files)
                dest = stage / "cp-baseline"
                if how == "staging":
                    result = train(data, work / f"staged-{rep}-{cache}", env, "--stage-to", str(stage))
                    seconds, _ = result["staging_s"], shas.append(result["param_sha256"])
                    assert result["staged_bytes"] == size, (result["staged_bytes"], size)
                    assert not any(stage.glob("hpctrain-*")), "staged copies left behind"
                else:
                    seconds = timed(lambda: BASELINES[how](data, per_rank, dest))
                shutil.rmtree(dest, ignore_errors=True)
                times.setdefault(f"{how} {cache}", []).append(seconds)
                print(f"  {how:8s} {cache}: {seconds:.2f} s", file=sys.stderr, flush=True)
    plain = train(data, work / "plain", env)
    rates = cpu_rates(data, per_rank[0], stage / "cpu")
    ratios = {f"staging / {how} {c}": [s / b for s, b in zip(times[f"staging {c}"], times[f"{how} {c}"])]
              for how in WAYS[:-1] for c in ("cold", "warm")}
    return {
        "bytes": size, "files": len(files), "data_dir": str(data), "stage_dir": str(stage), "repeats": args.repeats,
        "seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
        "ratios": ratios, "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "gb_per_cpu_s": rates,
        "param_sha256_unstaged": plain["param_sha256"], "param_sha256_staged": sorted(set(shas)),
        "bit_identical": set(shas) == {plain["param_sha256"]},
    }


def pick(path: str | None, need: float, fallback: Path) -> Path:
    if path is not None:
        return Path(path)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and shutil.disk_usage(shm).free > need else fallback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.4, help="dataset size in GB (default 2.4)")
    ap.add_argument("--data-dir", default=tempfile.gettempdir(), help="where the dataset is written (default: $TMPDIR or /tmp)")
    ap.add_argument("--stage-dir", help="the node-local directory (default: /dev/shm when it has room, else --data-dir)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep-data", action="store_true", help="keep the dataset (printed) for another run")
    ap.add_argument("--data", help="measure this existing shard set instead of writing one (it is kept)")
    args = ap.parse_args()
    need = args.gb * 1e9 * 1.1
    work = Path(tempfile.mkdtemp(prefix="hpctrain-staging-bench-", dir=args.data_dir))
    if shutil.disk_usage(work).free < 2 * need:
        raise SystemExit(f"{work}: {shutil.disk_usage(work).free / 1e9:.1f} GB free, need {2 * need / 1e9:.1f}")
    stage = pick(args.stage_dir, need, work) / f"stage-{os.getpid()}"
    stage.mkdir(parents=True)
    data = Path(args.data) if args.data else work / "data"
    try:
        if not args.data:
            n = int(args.gb * 1e9 / ROW_BYTES)
            t = timed(lambda: subprocess.run([sys.executable, "-m", "hpctrain", "shard", f"synthetic:{n}:{D}:10", str(data),
                                              "--shards", "8", "--val-fraction", "0.1"], check=True, capture_output=True))
            print(f"wrote {n} samples x {D} float32 to {data} in {t:.0f} s", file=sys.stderr, flush=True)
        result = measure(args, data, stage, work)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if args.keep_data:
            print(f"kept the dataset in {data}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return
    m, r = result["median_s"], result["median_ratio"]
    print(f"\nstaging {result['files']} files, {result['bytes'] / 1e9:.2f} GB (2 ranks) to {result['stage_dir']}; "
          f"medians of {result['repeats']} (ratios: of the pairs measured back to back)")
    print(f"{'page cache':>10} | {'cp (s)':>6} | {'cp x2 (s)':>9} | {'cp+sha (s)':>10} | {'staging_s':>9} | "
          f"{'staging GB/s':>12} | {'/ cp':>5} | {'/ cp x2':>7} | {'/ cp+sha':>8}")
    for c in ("cold", "warm"):
        print(f"{c:>10} | {m[f'cp {c}']:6.2f} | {m[f'cp x2 {c}']:9.2f} | {m[f'cp+sha {c}']:10.2f} | "
              f"{m[f'staging {c}']:9.2f} | {result['bytes'] / 1e9 / m[f'staging {c}']:12.2f} | "
              f"{r[f'staging / cp {c}']:5.2f} | {r[f'staging / cp x2 {c}']:7.2f} | {r[f'staging / cp+sha {c}']:8.2f}")
    print("GB per CPU-second (one rank's files, warm): " + ", ".join(f"{k} {v:.2f}" for k, v in result["gb_per_cpu_s"].items()))
    print(f"param_sha256 staged == unstaged: {result['bit_identical']} ({result['param_sha256_unstaged'][:16]}...)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
