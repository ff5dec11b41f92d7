#!/usr/bin/env python3
"""Packing a large text into language-model shards stays in bounded memory (issue: language models).

Writes ~1 GB of text (random words from a fixed list, one line per ~100 words) into a temporary directory,
as one file (one document: the worst case, nothing to split at) or `--docs N` files, then runs
`write_token_shards` on it (tokenize, pack into rows of seq_len + 1, write HDF5 shards with fletcher32,
sha256 every file, manifest, atomic rename) in a fresh subprocess, and reports as JSON that process's peak
RSS (getrusage RUSAGE_CHILDREN ru_maxrss; target < 1 GiB) and its throughput.

    python benchmarks/pack_rss.py [--gb 1.0] [--docs 1] [--text PATH] [--tokenizer bytes|tokenizer.json]
                                  [--seq-len 1024] [--shards 8] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = """
import json, sys, time
from pathlib import Path
from hpctrain.base.config import ShardConfig
from hpctrain.data.tokenshards import write_token_shards
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
m = write_token_shards(ShardConfig(**args))
wall = time.perf_counter() - t0
splits = m["splits"]
print(json.dumps({"wall_s": wall, "rows": m["num_samples"], "x": m["x"], "chunk_rows": m["chunk_rows"],
                  "text_bytes": sum(s["text_bytes"] for s in splits.values()),
                  "tokens": sum(s["tokens"] for s in splits.values()),
                  "documents": sum(s["documents"] for s in splits.values()),
                  "dropped_tokens": sum(s["dropped_tokens"] for s in splits.values()),
                  "shard_bytes": sum(p.stat().st_size for p in Path(args["out"]).rglob("*.h5"))}))
"""

WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this had not but "
         "were have it they one all their been has there who more when will would if no out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three "
         "naïve café über straße résumé 東京 données").split()


def make_text(folder: Path, total_bytes: int, docs: int) -> Path:
    """~total_bytes of UTF-8 text in `docs` files under folder; returns the file (docs == 1) or the folder."""
    rng = np.random.default_rng(0)
    words = np.array(WORDS)
    lines = [" ".join(rng.choice(words, 100)) + "\n" for _ in range(4000)]
    block = "".join(lines).encode()  # ~2.5 MB, written over and over, a different line order each time
    folder.mkdir(parents=True, exist_ok=True)
    per_doc = max(1, total_bytes // docs)
    for d in range(docs):
        with open(folder / f"doc-{d:06d}.txt", "wb") as fh:
            written = 0
            while written < per_doc:
                piece = block if written % 3 else "".join(rng.permutation(lines)).encode()
                piece = piece[:per_doc - written].decode("utf-8", "ignore").encode()  # whole characters only
                if not piece:
                    break
                fh.write(piece)
                written += len(piece)
    return folder / "doc-000000.txt" if docs == 1 else folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="text to generate, in GB (10^9 bytes)")
    ap.add_argument("--docs", type=int, default=1, help="files (documents) to spread it over")
    ap.add_argument("--text", type=Path, help="an existing text file or directory instead of generated text")
    ap.add_argument("--tokenizer", default="bytes")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--val-fraction", type=float, default=0.0)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--keep", action="store_true", help="leave the text and shards behind")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pack-rss-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        text = args.text or make_text(work / "text", int(args.gb * 1e9), args.docs)
        gen_s = time.perf_counter() - t0
        cfg = {"source": f"text:{text}", "out": str(work / "shards"), "tokenizer": args.tokenizer,
               "seq_len": args.seq_len, "shards": args.shards, "val_fraction": args.val_fraction}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True)
        total_s = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"packing failed ({proc.returncode}):\n{proc.stderr}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        report = {
            "text_bytes": child["text_bytes"], "documents": child["documents"], "tokenizer": args.tokenizer,
            "seq_len": args.seq_len, "shards": args.shards, "rows": child["rows"], "tokens": child["tokens"],
            "dropped_tokens": child["dropped_tokens"], "x": child["x"], "chunk_rows": child["chunk_rows"],
            "shard_bytes": child["shard_bytes"],
            "peak_rss_mib": round(peak / 2**20, 1), "under_1_gib": peak < 2**30,
            "write_token_shards_s": round(child["wall_s"], 2), "process_s": round(total_s, 2),
            "text_mb_per_s": round(child["text_bytes"] / 1e6 / child["wall_s"], 1),
            "tokens_per_s": round(child["tokens"] / child["wall_s"]),
            "generate_text_s": round(gen_s, 2), "work_dir": str(work) if args.keep else None,
        }
        print(json.dumps(report, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
