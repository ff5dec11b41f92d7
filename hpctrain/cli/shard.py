"""`hpctrain shard` and `hpctrain verify`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..base.config import SHARD_RENAMED, SHARD_SECTIONS, ShardConfig, section_panels
from .common import fail, handle_errors, is_rank0
from .options import config_parameters, take_renamed, with_signature


@handle_errors
def shard(ctx: typer.Context, json_out: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
          **values: Any) -> None:
    """Split SOURCE into per-rank HDF5 shards with a manifest.

    Writes into a hidden directory beside OUT and renames it into place, so a failure leaves nothing behind.

    Example: hpctrain shard digits data/ --shards 2

    Example: hpctrain shard text:corpus/ lm-data/ --seq-len 256 --shards 2 --val-fraction 0.05
    """
    from ..data.sharding import shard as write_shards

    take_renamed(ctx, values, SHARD_RENAMED)
    cfg = ShardConfig(**values)
    manifest = write_shards(cfg, show_progress=not json_out)
    if not is_rank0():
        return
    if json_out:
        print(json.dumps(manifest))
    elif manifest.get("task") == "lm":
        splits = ", ".join(f"{name} {body['samples']} rows ({body['tokens']:,} tokens of {body['text_bytes']:,} "
                           f"text bytes)" for name, body in manifest["splits"].items())
        print(f"wrote {manifest['num_shards']} shards per split to {cfg.out}: {splits}; rows of "
              f"{manifest['seq_len']} + 1 tokens, vocabulary {manifest['vocab_size']} ({manifest['tokenizer']['name']})")
        if manifest["val_fraction"] > 0 and "val" not in manifest["splits"]:  # the split is by document
            print(f"note: no val split: {cfg.source} is one document; give the text as several files or JSONL lines "
                  "to get one", file=sys.stderr)
    else:
        splits = ", ".join(f"{name} {body['samples']}" for name, body in manifest["splits"].items())
        print(f"wrote {manifest['num_shards']} shards per split to {cfg.out} ({splits} samples, "
              f"{manifest['num_classes']} classes, x {manifest['x']['dtype']} {tuple(manifest['x']['shape'])})")


with_signature(shard, config_parameters(ShardConfig, arguments=("source", "out"), renamed=SHARD_RENAMED,
                                        panels=section_panels(SHARD_SECTIONS)))


@handle_errors
def verify(
    out: Annotated[Path, typer.Argument(help="A directory written by `hpctrain shard`.")],
    quick: Annotated[bool, typer.Option("--quick", help="Check sizes and datasets only, skip the sha256 pass (and the row check of token shards).")] = False,
) -> None:
    """Re-check every shard against the manifest (sizes, datasets, sha256; for token shards also that the rows
    follow the packing rule); name any file that differs.

    Example: hpctrain verify data/
    """
    from ..data.shardformat import load_manifest, verify as verify_shards

    problems = verify_shards(out, quick=quick, show_progress=True)
    if problems:
        for p in problems:
            print(p)
        raise fail(f"{len(problems)} problem(s) in {out}; re-create the data with `hpctrain shard`", 1)
    count = sum(len(f) for f in load_manifest(out).splits.values())
    print(f"ok: {count} shard files in {out} match the manifest")
