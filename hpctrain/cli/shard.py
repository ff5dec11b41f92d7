"""`hpctrain shard` and `hpctrain verify`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..base.config import ShardConfig
from .common import fail, handle_errors, is_rank0


@handle_errors
def shard(
    source: Annotated[str, typer.Argument(help="digits, synthetic:N[:D[:C]], FILE.npz, FILE.h5/.hdf5, FILE.csv, imagefolder:DIR, mnist:DIR, cifar10:DIR or FILE.parquet.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).")],
    shards: Annotated[int, typer.Option(help="Shards per split; train on a world size that divides it.")] = 8,
    val_fraction: Annotated[float, typer.Option(help="Fraction of samples held out for validation.")] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed of the train/val split (and of synthetic data).")] = 0,
    compression: Annotated[str, typer.Option(help="HDF5 compression: none, lzf or gzip.")] = "none",
    chunk_rows: Annotated[Optional[int], typer.Option(help="Rows per HDF5 chunk (default: about 1 MiB).")] = None,
    normalize: Annotated[str, typer.Option(help="none, standard or minmax, per feature from the training samples.")] = "none",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing dataset at OUT.")] = False,
    image_size: Annotated[Optional[str], typer.Option(help="Image sources: scale and center-crop to H or HxW.")] = None,
    channels: Annotated[Optional[int], typer.Option(help="Image sources: 1 (grayscale) or 3 (RGB).")] = None,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Image sources: skip unreadable images (counted).")] = False,
    workers: Annotated[int, typer.Option(help="Worker processes decoding images or writing shards from an HDF5 source (0: one per CPU).")] = 0,
    label_column: Annotated[Optional[str], typer.Option(help="FILE.parquet: label column (default: last).")] = None,
    fsync: Annotated[bool, typer.Option("--fsync", help="fsync every file before OUT appears (durable; waits for the disk).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Split SOURCE into per-rank HDF5 shards with a manifest.

    Example: hpctrain shard digits data/ --shards 2
    """
    from ..data.sharding import shard as write_shards

    cfg = ShardConfig(source=source, out=out, shards=shards, val_fraction=val_fraction, seed=seed,
                      compression=compression, chunk_rows=chunk_rows, normalize=normalize, force=force, image_size=image_size,
                      channels=channels, skip_bad=skip_bad, workers=workers, label_column=label_column,
                      fsync=fsync)
    manifest = write_shards(cfg, show_progress=not json_out)
    if not is_rank0():
        return
    if json_out:
        print(json.dumps(manifest))
    else:
        splits = ", ".join(f"{name} {body['samples']}" for name, body in manifest["splits"].items())
        print(f"wrote {manifest['num_shards']} shards per split to {out} ({splits} samples, "
              f"{manifest['num_classes']} classes, x {manifest['x']['dtype']} {tuple(manifest['x']['shape'])})")


@handle_errors
def verify(
    out: Annotated[Path, typer.Argument(help="A directory written by `hpctrain shard`.")],
    quick: Annotated[bool, typer.Option("--quick", help="Check sizes and datasets only, skip the sha256 pass.")] = False,
) -> None:
    """Re-check every shard against the manifest; name any file that differs.

    Example: hpctrain verify data/
    """
    from ..data.reader import load_manifest, verify as check

    problems = check(out, quick=quick, show_progress=True)
    if problems:
        for p in problems:
            print(p)
        raise fail(f"{len(problems)} problem(s) in {out}; re-create the data with `hpctrain shard`", 1)
    count = sum(len(f) for f in load_manifest(out).splits.values())
    print(f"ok: {count} shard files in {out} match the manifest")
