"""`hpctrain bench data`: the shard reader's throughput beside a raw contiguous h5py read of the same shards,
and each epoch's wait for its first batch."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ..comm import Comm


def bench_data(comm: Comm, data: str, *, batch_size: int = 256, epochs: int = 2, shuffle: bool = True) -> dict[str, Any]:
    """This rank's reader throughput over whole epochs, beside a raw contiguous h5py read of the same shards.

    The raw read is the ceiling: each of the rank's files read front to back in large slices into one reused
    buffer (fresh memory for every slice cost more than the read on the 2-core machine). The reader
    adds block shuffling, batching, normalization and the prefetch thread. `first_batch_ms` is each epoch's
    wait for its first batch (the slowest rank's): what a training step waits at an epoch's start, when the
    first window is read with nothing to overlap it. `held`: every rank's split fits one window, so the reader
    read it at the first epoch only and gathers later epochs from memory (`ShardReader.held`).
    """
    import h5py

    from ..data.reader import ShardReader
    from ..data.shardformat import load_manifest
    from ..data.hdf5env import reader_locking

    shards = load_manifest(data)
    reader = ShardReader(shards, "train", rank=comm.rank, world=comm.size, batch_size=batch_size, shuffle=shuffle)
    row_bytes = shards.row_bytes
    # the raw read's slices: the reader's windows, no larger than the rank's largest file
    step = max(1, min(reader.window_rows, max((f.samples for f in reader.files), default=1)))
    raw_x = np.empty((step, *shards.x_shape), np.dtype(shards.x_dtype))  # reused, as the reader reuses its windows
    raw_x.fill(0)

    def read_all_raw() -> int:
        n = 0
        for f in reader.files:
            with h5py.File(f.path, "r", locking=reader_locking()) as h5:
                for s in range(0, f.samples, step):
                    rows = min(step, f.samples - s)
                    h5["x"].read_direct(raw_x, np.s_[s:s + rows], np.s_[:rows])
                    n += rows
                    h5["y"][s:s + step]
        return n

    first: list[float] = []

    def read_reader(epoch: int) -> int:
        t0, n = time.perf_counter(), 0
        for b in reader.epoch(epoch):
            if not n:
                first.append(time.perf_counter() - t0)
            n += len(b.y)
        return n

    read_all_raw()  # warm the page cache for both
    raw_t, reader_t = [], []
    samples = 0
    for _ in range(epochs):
        t0 = time.perf_counter()
        samples = read_all_raw()
        raw_t.append(time.perf_counter() - t0)
    for e in range(epochs):  # on their own, as in `train`: a raw read in between frees memory the reader then gets
        t0 = time.perf_counter()
        read_reader(e)
        reader_t.append(time.perf_counter() - t0)
    held = bool(comm.allreduce_array([reader.held], op="min")[0])
    reader.close()
    raw_s = float(comm.allreduce_array([statistics.median(raw_t)], op="max")[0])
    rd_s = float(comm.allreduce_array([statistics.median(reader_t)], op="max")[0])
    total = float(comm.allreduce_array([samples])[0])
    return {"world_size": comm.size, "samples": int(total), "sample_bytes": row_bytes, "batch_size": batch_size,
            "shuffle": shuffle, "raw_samples_per_s": total / raw_s, "reader_samples_per_s": total / rd_s,
            "raw_mb_per_s": total * row_bytes / raw_s / 1e6, "reader_mb_per_s": total * row_bytes / rd_s / 1e6,
            "reader_over_raw": raw_s / rd_s, "held": held,
            "first_batch_ms": [float(v) * 1e3 for v in comm.allreduce_array(first, op="max")]}
