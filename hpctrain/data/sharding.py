"""`hpctrain shard`: read a SOURCE and write per-rank HDF5 shards plus a manifest.

The split is a seeded permutation of the samples: the first `val_fraction` go to `val`, the rest to
`train`, and each split is cut into `shards` parts whose sizes differ by at most one. Inside a shard,
samples keep the order of the source (the reader shuffles per epoch), which lets the writer stream: it
reads the source in chunks and appends each chunk's rows to their shards, so memory stays bounded by one
chunk whatever the size of the source.

Everything is written into a hidden temporary directory beside OUT and renamed into place at the end, so
a failure leaves nothing behind and a reader never sees a half-written dataset. `--fsync` also makes every
file durable before the rename (the command then waits for the disk); without it, as with cp, a crash of
the node just after `shard` returns can tear a file, which the manifest's sha256 and the per-chunk
fletcher32 checks detect.

The SOURCE is opened here (`open_source`): the simple forms by `sources`, the image and dataset-file forms
by `imagesets`.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..comm import Comm, world
from ..base.config import ShardConfig
from ..base.rankenv import RankEnv, read_env
from .shardformat import (FORMAT, NORMALIZED_ON_WRITE, SPLITS, VERSION, commit, discard_partial,
                          hash_and_sync, safe_to_replace, shard_name, write_manifest)
from ..base.errors import ConfigError, DataError, HpctrainError
from .sources import Source, open_simple_source
from .text import text_form
from ..base.threads import worker_context
from ..base.progress import Progress

_READ_BYTES = 64 << 20  # rows of the source read at a time: about this many bytes of x


def _store_dtype(dtype: np.dtype) -> np.dtype:
    """Floats and uint8 (images, normalized by the reader as the manifest says) are stored as they are;
    anything else as float32 (train reads x as float32)."""
    if np.issubdtype(dtype, np.floating) or dtype == np.uint8:
        return dtype
    return np.dtype(np.float32)


def open_source(spec: str, seed: int = 0, cfg: ShardConfig | None = None) -> Source:
    """Open SOURCE (see sources.SOURCE_FORMS); raise DataError naming the value when it cannot be used."""
    if spec.startswith(("imagefolder:", "mnist:", "cifar10:")) or spec.lower().endswith(".parquet"):
        from .imagesets import open_dataset_source

        return open_dataset_source(spec, cfg or ShardConfig(source=spec, out=Path(".")))
    return open_simple_source(spec, seed)


def _bounds(n: int, parts: int) -> np.ndarray:
    """Start offsets of `parts` pieces of `n` items whose sizes differ by at most one."""
    return np.array([(n * k) // parts for k in range(parts + 1)])


def assign(n: int, shards: int, val_fraction: float, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Destination of every sample: a slot id (split * shards + shard) and each split's shard sizes."""
    perm = np.random.default_rng([seed, 3]).permutation(n)
    n_val = int(round(n * val_fraction))
    slot = np.empty(n, np.int32)
    sizes: dict[str, np.ndarray] = {}
    for s, ids in enumerate((perm[n_val:], perm[:n_val])):
        bounds = _bounds(len(ids), shards)
        for k in range(shards):
            slot[ids[bounds[k]:bounds[k + 1]]] = s * shards + k
        sizes[SPLITS[s]] = np.diff(bounds)
    return slot, sizes


def _chunk_rows(cfg: ShardConfig, row_bytes: int) -> int:
    return cfg.chunk_rows or int(max(1, min(1 << 16, (1 << 20) // max(1, row_bytes))))


def shard(cfg: ShardConfig, *, show_progress: bool = True, comm: Comm | None = None,
          env: RankEnv | None = None) -> dict[str, Any]:
    """Write the shards and manifest for `cfg`; return the manifest.

    Under a launcher (`mpirun -n K hpctrain shard ...`) the K ranks write in parallel, each its own files,
    and rank 0 writes the one manifest at the end; started alone, no MPI is initialized. `env` (the rank's
    environment, read here when not given) sizes `--workers 0`: the CPUs this rank owns.
    """
    env = env or read_env()
    if cfg.workers == 0:
        cfg = dataclasses.replace(cfg, workers=env.torch_threads())
    if comm is None:
        comm = world() if env.under_launcher else Comm(None)
    if text_form(cfg.source) is not None:
        return _shard_text(cfg, comm)
    error: HpctrainError | None = None
    source = None
    out = cfg.out
    try:
        source = _open_checked(cfg)
    except HpctrainError as exc:
        error = exc
    try:
        comm.agree(error)
        assert source is not None
        slot, sizes = assign(source.n, cfg.shards, cfg.val_fraction, cfg.seed)
        dtype = np.dtype(np.float32) if cfg.normalize != "none" else _store_dtype(source.x_dtype)
        row_bytes = int(np.prod(source.x_shape, dtype=np.int64)) * dtype.itemsize
        chunk_rows = _chunk_rows(cfg, row_bytes)
        read_rows = max(chunk_rows, _READ_BYTES // max(1, row_bytes))
        created = [p for p in [*out.parents][::-1] if not p.exists()]
        tmp = out.parent / f".{out.name}.tmp-{comm.bcast(os.getpid())}"
        norm = None
        if cfg.normalize != "none":
            norm = comm.bcast(_statistics(cfg, source, slot, read_rows, show_progress) if comm.rank == 0 else None)
        error = None
        manifest: dict[str, Any] = {}
        try:
            if comm.rank == 0:
                out.parent.mkdir(parents=True, exist_ok=True)
                for split in SPLITS:
                    if sizes[split].sum() > 0:
                        (tmp / split).mkdir(parents=True, exist_ok=True)
            comm.barrier()
            files = sum(int((sizes[split] > 0).sum()) for split in SPLITS)
            workers = min(cfg.workers, files)
            if comm.size == 1 and source.reopenable and workers > 1:
                digests = _write_in_workers(cfg, source, slot, sizes, workers, dtype, chunk_rows, read_rows, tmp, norm,
                                            show_progress)
            else:
                digests = _write(cfg, source, slot, sizes, dtype, chunk_rows, read_rows, tmp, norm,
                                 (comm.rank, comm.size), show_progress and comm.rank == 0)
        except HpctrainError as exc:
            error = exc
        except OSError as exc:
            error = DataError(f"writing shards into {str(tmp)!r} failed: {exc}")
        try:
            comm.agree(error)
            gathered = comm.gather(digests)
            if comm.rank == 0:
                merged = {k: v for part in gathered for k, v in part.items()}
                manifest = _manifest(cfg, source, sizes, dtype, chunk_rows, norm, merged, tmp)
                commit(tmp, out, cfg.fsync)
            manifest = comm.bcast(manifest)
        except BaseException:
            if comm.rank == 0:
                discard_partial(tmp, created)
            raise
    finally:
        if source is not None:
            source.close()
    return manifest


def _shard_text(cfg: ShardConfig, comm: Comm) -> dict[str, Any]:
    """Text for language models (`tokenshards`): one process tokenizes and packs the stream (rank 0 under a
    launcher; the others wait for its manifest)."""
    from .tokenshards import write_token_shards

    manifest, error = None, None
    if comm.rank == 0:
        try:
            manifest = write_token_shards(cfg)
        except HpctrainError as exc:
            error = exc
    comm.agree(error if comm.rank == 0 else None)
    return comm.bcast(manifest)


def _open_checked(cfg: ShardConfig) -> Source:
    """The source, once OUT may be written and every split has at least one sample per shard."""
    out = cfg.out
    if out.exists() and not cfg.force:
        raise ConfigError(f"OUT {str(out)!r} already exists: choose another directory or pass --force to replace it")
    if out.exists() and not safe_to_replace(out):
        raise ConfigError(f"OUT {str(out)!r} exists and is not an hpctrain dataset; refusing to replace it even with --force")
    source = open_source(cfg.source, cfg.seed, cfg)
    n_val = int(round(source.n * cfg.val_fraction))
    for split, count in (("train", source.n - n_val), ("val", n_val)):
        if 0 < count < cfg.shards or (split == "train" and count < cfg.shards):
            source.close()
            raise ConfigError(f"--shards {cfg.shards} is more than the {count} {split} samples of {cfg.source!r}: "
                              f"use --shards {max(1, min(count, cfg.shards))} or fewer")
    return source


def _statistics(cfg: ShardConfig, source: Source, slot: np.ndarray, read_rows: int, show: bool) -> dict[str, Any]:
    """Per-feature offset and scale for --normalize, from one streaming pass over the training samples."""
    is_train = slot < cfg.shards
    shape = source.x_shape
    total = np.zeros(shape, np.float64)
    squares = np.zeros(shape, np.float64)
    low = np.full(shape, np.inf)
    high = np.full(shape, -np.inf)
    n = 0
    with Progress(source.n, f"statistics for --normalize {cfg.normalize}", enabled=show, unit="samples") as bar:
        for start in range(0, source.n, read_rows):
            stop = min(source.n, start + read_rows)
            x = source.read(start, stop)[is_train[start:stop]].astype(np.float64)
            n += len(x)
            if cfg.normalize == "standard":
                total += x.sum(axis=0)
                squares += np.square(x).sum(axis=0)
            elif len(x):
                low = np.minimum(low, x.min(axis=0))
                high = np.maximum(high, x.max(axis=0))
            bar.update(stop - start)
    if cfg.normalize == "standard":
        mean = total / max(1, n)
        std = np.sqrt(np.maximum(squares / max(1, n) - mean**2, 0.0))
        offset, scale = mean, np.where(std > 0, std, 1.0)
    else:
        offset, scale = low, np.where(high > low, high - low, 1.0)
    return {"method": cfg.normalize, "computed_on": f"train split ({n} samples)", "formula": "x = (x - offset) / scale",
            "offset": offset.astype(np.float32).tolist(), "scale": scale.astype(np.float32).tolist()}


def _write_in_workers(cfg: ShardConfig, source: Source, slot: np.ndarray, sizes: dict[str, np.ndarray], workers: int,
                      dtype: np.dtype, chunk_rows: int, read_rows: int, tmp: Path, norm: dict[str, Any] | None,
                      show_progress: bool) -> dict[str, str]:
    """One process alone writes as `workers` processes, each its share of the files (as K ranks would):
    HDF5 writes one dataset at a time per process, and the fletcher32 and sha256 passes are CPU-bound.
    This process writes share 0 with the source it has open while workers - 1 new ones start and write
    the others."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ctx = worker_context(["hpctrain.data.sharding", "h5py"])  # never fork: the source's HDF5 file is open here
    digests: dict[str, str] = {}
    try:
        with ProcessPoolExecutor(workers - 1, mp_context=ctx) as pool:
            jobs = [pool.submit(_write_part, cfg, (w, workers), dtype, chunk_rows, read_rows, tmp, norm, False)
                    for w in range(1, workers)]
            digests.update(_write(cfg, source, slot, sizes, dtype, chunk_rows, read_rows, tmp, norm, (0, workers),
                                  show_progress))
            for job in jobs:
                digests.update(job.result())
    except BrokenProcessPool as exc:
        raise DataError(f"a shard writer process died ({exc}); out of memory? retry with --workers 1") from None
    return digests


def _write_part(cfg: ShardConfig, part: tuple[int, int], dtype: np.dtype, chunk_rows: int, read_rows: int, tmp: Path,
                norm: dict[str, Any] | None, show_progress: bool) -> dict[str, str]:
    """A worker process: open the source anew and write its share of the files."""
    source = open_source(cfg.source, cfg.seed, cfg)
    try:
        slot, sizes = assign(source.n, cfg.shards, cfg.val_fraction, cfg.seed)
        return _write(cfg, source, slot, sizes, dtype, chunk_rows, read_rows, tmp, norm, part, show_progress)
    finally:
        source.close()


def _write(cfg: ShardConfig, source: Source, slot: np.ndarray, sizes: dict[str, np.ndarray], dtype: np.dtype,
           chunk_rows: int, read_rows: int, tmp: Path, norm: dict[str, Any] | None, part: tuple[int, int],
           show_progress: bool) -> dict[str, str]:
    """Write part (index, count) of the shard files (a rank's or a worker's); return {relative path: sha256}."""
    import h5py

    shards = cfg.shards
    filters: dict[str, Any] = {"fletcher32": True}
    if cfg.hdf5_compression != "none":
        filters.update(compression=cfg.hdf5_compression, shuffle=True)
    live = [(s, k) for s, split in enumerate(SPLITS) for k in range(shards) if sizes[split][k] > 0]
    mine = live[part[0]::part[1]]
    offset = scale = None
    if norm is not None:
        offset = np.asarray(norm["offset"], np.float32)
        scale = np.asarray(norm["scale"], np.float32)
    # Keep at most this many files open at once; more slots take more passes over the source.
    per_pass = 256
    digests: dict[str, str] = {}
    gather: np.ndarray | None = None
    # the chunk cache holds a few chunks per dataset, so a chunk split between two writes is not evicted
    # half-filled (and, with fletcher32, read back and checked) before its second half arrives
    cache = max(4 << 20, 4 * chunk_rows * int(np.prod(source.x_shape, dtype=np.int64)) * dtype.itemsize)
    with Progress(source.n * max(1, -(-len(mine) // per_pass)), f"shard {cfg.source}", enabled=show_progress,
                  unit="samples") as bar:
        for g in range(0, len(mine), per_pass):
            group = mine[g:g + per_pass]
            files, pos = {}, {}
            try:
                for s, k in group:
                    count = int(sizes[SPLITS[s]][k])
                    h5 = h5py.File(tmp / SPLITS[s] / shard_name(k, shards), "w", locking=False, rdcc_nbytes=cache)
                    rows = min(chunk_rows, count)
                    h5.create_dataset("x", (count, *source.x_shape), dtype=dtype, chunks=(rows, *source.x_shape), **filters)
                    h5.create_dataset("y", (count,), dtype=np.int64, chunks=(min(count, max(rows, 1024)),), **filters)
                    h5.create_dataset("index", (count,), dtype=np.int64, chunks=(min(count, max(rows, 1024)),), **filters)
                    files[s * shards + k] = h5
                    pos[s * shards + k] = 0
                for start in range(0, source.n, read_rows):
                    stop = min(source.n, start + read_rows)
                    keys = slot[start:stop]
                    wanted = np.isin(keys, list(files)) if part[1] > 1 or len(group) < len(live) else None
                    if wanted is not None and not wanted.any():
                        bar.update(stop - start)
                        continue
                    x = source.read(start, stop)
                    if x.shape[1:] != source.x_shape:
                        raise DataError(f"{cfg.source!r}: rows {start}:{stop} have shape {x.shape[1:]}, expected {source.x_shape}")
                    order = np.argsort(keys, kind="stable")
                    edges = np.flatnonzero(np.diff(keys[order])) + 1
                    for run in np.split(order, edges):
                        key = int(keys[run[0]])
                        h5 = files.get(key)
                        if h5 is None:
                            continue
                        p, m = pos[key], len(run)
                        if gather is None or len(gather) < m or gather.dtype != x.dtype:
                            gather = np.empty((max(m, len(x)), *x.shape[1:]), x.dtype)
                        # into a buffer reused, not a new array per run ("clip": numpy buffers `out` under "raise")
                        rows_x = np.take(x, run, axis=0, out=gather[:m], mode="clip")
                        if offset is not None:
                            rows_x = (rows_x.astype(np.float32) - offset) / scale
                        h5["x"][p:p + m] = rows_x.astype(dtype, copy=False)
                        h5["y"][p:p + m] = source.y[start + run]
                        h5["index"][p:p + m] = start + run
                        pos[key] = p + m
                    bar.update(stop - start)
            finally:
                for h5 in files.values():
                    h5.close()
            # hash this group's files and make them durable, in parallel threads (hashlib and fsync release
            # the GIL): one file's fsync overlaps another's hashing
            rels = [f"{SPLITS[s]}/{shard_name(k, shards)}" for s, k in group]
            with ThreadPoolExecutor(max_workers=max(1, min(len(rels), os.cpu_count() or 1))) as pool:
                digests.update(zip(rels, pool.map(lambda rel: hash_and_sync(tmp / rel, cfg.fsync), rels)))
    return digests


def _manifest(cfg: ShardConfig, source: Source, sizes: dict[str, np.ndarray], dtype: np.dtype, chunk_rows: int,
              norm: dict[str, Any] | None, digests: dict[str, str], tmp: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": cfg.source,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "num_shards": cfg.shards,
        "num_classes": source.num_classes,
        "num_samples": source.n,
        "x": {"dtype": dtype.name, "shape": list(source.x_shape)},
        "y": {"dtype": "int64", "shape": []},
        "chunk_rows": chunk_rows,
        "compression": cfg.hdf5_compression,
        "fletcher32": True,
        **source.meta,
        "splits": {},
    }
    if norm is not None:
        manifest[NORMALIZED_ON_WRITE] = norm
    for split in SPLITS:
        if sizes[split].sum() == 0:
            continue
        entries = []
        for k in range(cfg.shards):
            rel = f"{split}/{shard_name(k, cfg.shards)}"
            entries.append({"file": rel, "samples": int(sizes[split][k]), "sha256": digests[rel]})
        manifest["splits"][split] = {"samples": int(sizes[split].sum()), "shards": entries}
    write_manifest(tmp, manifest, cfg.fsync)
    return manifest
