#!/usr/bin/env python3
"""Decoding throughput of the imagefolder source: images per second with 1, 2, ... worker processes.

Three folders: scikit-learn's digits rendered as 1,797 PNG files of 8x8 pixels (`datasets/digits_to_imagefolder.py`;
tiny files, so the cost per file dominates), and two generated folders of JPEG images (smooth noise and a
shape): 160x120 sharded with --image-size 64, and ImageNet-sized 500x375 sharded with --image-size 224
--channels 3 (no header scan; decode, resize and crop dominate). For each worker count it runs
the whole `hpctrain shard` (header scan, the checking decode pass, the HDF5 write; worker start-up included)
and, separately, `open_dataset_source` alone (the header scan and the checking decode, where the workers work), and
reports images/s = images / wall seconds, best and median of `--repeats` runs that alternate between worker
counts (on a shared machine the best run is the one least disturbed). `--stream` forces the large-dataset
path (pixels not kept from the checking pass, decoded again while writing).

    python benchmarks/image_decode.py [--workers 1 2] [--repeats 5] [--jpegs 1500] [--large 900] [--stream] [--json]
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_jpegs(out: Path, count: int, size: tuple[int, int] = (160, 120), seed: int = 0) -> None:
    """`count` JPEG files of size (W, H) in 10 class folders: smooth color noise with an ellipse on it."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    w, h = size
    for i in range(count):
        cls = f"class{i % 10}"
        (out / cls).mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
        draw = ImageDraw.Draw(img)
        x, y = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        draw.ellipse((x, y, x + w // 3, y + h // 3), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        img.save(out / cls / f"{i:05d}.jpg", quality=90)


def decode_once(source: str, workers: int, extra: dict) -> float:
    """Seconds for `open_dataset_source` alone: header scan and the checking decode of every image."""
    from hpctrain.base.config import ShardConfig
    from hpctrain.data.imagesets import open_dataset_source

    t0 = time.perf_counter()
    open_dataset_source(source, ShardConfig(source=source, out=Path("unused"), workers=workers, **extra)).close()
    return time.perf_counter() - t0


def shard_once(source: str, out: Path, workers: int, extra: dict) -> float:
    """Seconds for the whole `hpctrain shard`: listing, scan, decode, HDF5 write and hashes."""
    from hpctrain.base.config import ShardConfig
    from hpctrain.data.sharding import shard

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    shard(ShardConfig(source=source, out=out, shards=2, workers=workers, **extra), show_progress=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jpegs", type=int, default=1500, help="images in the generated 160x120 JPEG folder")
    ap.add_argument("--large", type=int, default=900, help="images in the generated 500x375 (ImageNet-like) JPEG folder")
    ap.add_argument("--stream", action="store_true", help="decode twice, as for a dataset too big to keep")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from hpctrain.data import images

    if args.stream:
        images._KEEP_BYTES = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "datasets" / "digits_to_imagefolder.py"), str(tmp_path / "digits")],
                       check=True, capture_output=True)
        make_jpegs(tmp_path / "jpegs", args.jpegs)
        make_jpegs(tmp_path / "large", args.large, (500, 375))
        cases = [("digits PNG 8x8", f"imagefolder:{tmp_path / 'digits'}", 1797, {}),
                 ("JPEG 160x120 -> 64x64", f"imagefolder:{tmp_path / 'jpegs'}", args.jpegs, {"image_size": "64"}),
                 ("JPEG 500x375 -> 224x224", f"imagefolder:{tmp_path / 'large'}", args.large,
                  {"image_size": "224", "channels": 3})]
        results = []
        for name, source, count, extra in cases:
            shard_once(source, tmp_path / "warm", max(args.workers), extra)  # start the forkserver, warm caches
            decode: dict[int, list[float]] = {w: [] for w in args.workers}
            whole: dict[int, list[float]] = {w: [] for w in args.workers}
            for _ in range(args.repeats):
                for w in args.workers:
                    decode[w].append(decode_once(source, w, extra))
                    whole[w].append(shard_once(source, tmp_path / "out", w, extra))
            for w in args.workers:
                results.append({"dataset": name, "images": count, "workers": w, "stream": args.stream,
                                "decode_s": {"best": min(decode[w]), "median": statistics.median(decode[w])},
                                "shard_s": {"best": min(whole[w]), "median": statistics.median(whole[w])}})
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "load_average": load, "repeats": args.repeats, "results": results}))
        return
    print(f"{os.cpu_count()} CPUs, load average {load:.1f} at the end; {args.repeats} runs each, best (median) images/s")
    print("decode = open_dataset_source: header scan + checking decode; shard = the whole command (adds listing, "
          f"HDF5 write, hashes){'; decoding twice' if args.stream else ''}")
    print(f"{'dataset':<24} {'images':>6} {'workers':>7} {'decode images/s':>20} {'shard images/s':>20}")
    base: dict[str, float] = {}
    for r in results:
        rate = {k: {m: r["images"] / v for m, v in r[k].items()} for k in ("decode_s", "shard_s")}
        base.setdefault(r["dataset"], rate["decode_s"]["best"])
        speed = rate["decode_s"]["best"] / base[r["dataset"]]
        print(f"{r['dataset']:<24} {r['images']:>6} {r['workers']:>7} "
              f"{rate['decode_s']['best']:>7.0f} ({rate['decode_s']['median']:>5.0f}) {speed:4.2f}x "
              f"{rate['shard_s']['best']:>11.0f} ({rate['shard_s']['median']:>5.0f})")


if __name__ == "__main__":
    main()
