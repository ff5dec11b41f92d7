#!/usr/bin/env bash
# A language model end to end, from the repository root: real text (seven modules of the running Python's
# own standard library, about 110 KB, read where the interpreter keeps them) -> token shards -> a small GPT
# trained on 2 ranks -> text sampled from it.
#
#   bash examples/language_model.sh            # about a minute on 2 cores; OUT=... STEPS=... to change
#
# For the README's number (a few MB of text, 10 minutes): python benchmarks/lm_bpb.py
set -euo pipefail
OUT=${OUT:-runs/lm-example}
STEPS=${STEPS:-600}
TEXT=${TEXT:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}
GLOB=${GLOB:-'[bh]*.py'}  # base64, bdb, bisect, bz2, hashlib, heapq, hmac

hpctrain shard "text:$TEXT" "$OUT/data" --glob "$GLOB" --seq-len 64 --shards 2 --val-fraction 0.15 --force
rm -rf "$OUT/run"
hpctrain launch -n 2 -- train --data "$OUT/data" --run-dir "$OUT/run" --model gpt:layers=2,dim=128,heads=4 \
    --optimizer adamw --lr 3e-3 --batch-size 16 --epochs 1000 --max-steps "$STEPS" --schedule cosine \
    --log-every 100 --json > "$OUT/summary.json"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print(f\"val {s['val_bits_per_byte']:.2f} bits per byte, \
{s['tokens_per_s']:.0f} tokens/s, MFU {s['mfu']:.2f}\")" "$OUT/summary.json"
hpctrain generate "$OUT/run" --prompt "def " --tokens 200 --temperature 0.7
