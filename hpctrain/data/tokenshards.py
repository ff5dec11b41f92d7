"""Language-model shards: text SOURCE -> tokens -> packed rows -> per-rank HDF5 shards plus a manifest.

The on-disk conventions are `sharding`'s: `OUT/manifest.json` and `OUT/{train,val}/shard-*.h5`, every dataset
chunked and fletcher32-checked (with the shuffle filter when compressed), a sha256 per file in the manifest,
everything written into a hidden temporary directory beside OUT and renamed into place at the end (nothing
half-written is ever seen; a failure leaves nothing behind), `fsync` optional as there.

What differs, because the input is a stream whose length is known only at its end:
- a shard holds `x` (rows, seq_len + 1) of uint16 (uint32 for a vocabulary over 65,536) and `index` (the
  row's number in its split, int64); there is no `y`: the targets are x[:, 1:] (see `tokens`), and a reader
  that expects labels fails on the missing dataset instead of training on made-up ones;
- documents go to train or val by `text.is_val` (every 1/f-th document), not by a seeded permutation;
- rows are written as they are packed: each block of `shards * chunk_rows` rows gives every shard one
  contiguous, chunk-aligned run of `chunk_rows` rows (one full HDF5 chunk per write), and the last, shorter
  block is dealt round-robin, so shard sizes still differ by at most one row;
- packing runs on this thread while a second one writes HDF5 (at most `QUEUE_BLOCKS` blocks between them);
  the sha256 passes run on a thread per file. Memory is bounded by a few blocks (32 MiB each at most), a
  few text pieces and HDF5's cost of each open file (about 0.5 MiB; 2 * shards files are open), whatever
  the size of the text. An HDF5 chunk is stored whole, so a file holds up to one chunk (1 MiB) of padding.

The manifest is `sharding`'s, so `shardformat.load_manifest` reads it, with `task: "lm"` and the LM entries
(see `lm_manifest`).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..base.config import ShardConfig
from ..base.errors import ConfigError, DataError
from .shardformat import (FORMAT, LM_VERSION, SPLITS, TOKENIZER_FILE, commit, discard_partial,
                          hash_and_sync, safe_to_replace, shard_name, write_manifest)
from .text import Document, check_val_split, open_documents, split_documents, text_form, TEXT_FORMS
from .tokens import Packer, PackStats, Tokenizer, load_tokenizer, token_dtype, tokenize_tagged, train_bpe

TASK = "lm"
QUEUE_BLOCKS = 2  # packed blocks waiting for the HDF5 writer thread
MAX_BLOCK_BYTES = 32 << 20  # a block is shards * chunk_rows rows: at most this, or one row per shard
CHUNK_BYTES = 1 << 20  # default HDF5 chunk of x: about this many bytes


def chunk_rows_for(cfg: ShardConfig, row_bytes: int) -> int:
    """Rows per HDF5 chunk: about CHUNK_BYTES, fewer when a block (one chunk per shard) would pass MAX_BLOCK_BYTES."""
    return cfg.chunk_rows or max(1, min(CHUNK_BYTES, MAX_BLOCK_BYTES // cfg.shards) // row_bytes)


class _SplitWriter:
    """The shard files of one split, opened at its first block; each block appended as the module says."""

    def __init__(self, folder: Path, cfg: ShardConfig, dtype: np.dtype, chunk_rows: int):
        self.folder, self.cfg, self.dtype, self.chunk_rows = folder, cfg, dtype, chunk_rows
        self.files: list[Any] = []
        self.sizes = np.zeros(cfg.shards, np.int64)
        self.rows = 0

    def _open(self) -> None:
        import h5py

        filters: dict[str, Any] = {"fletcher32": True}
        if self.cfg.hdf5_compression != "none":
            filters.update(compression=self.cfg.hdf5_compression, shuffle=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        width, rows = self.cfg.seq_len + 1, self.chunk_rows
        for k in range(self.cfg.shards):
            # no chunk cache: every chunk is written whole, once, so none is ever read back
            h5 = h5py.File(self.folder / shard_name(k, self.cfg.shards), "w", locking=False, rdcc_nbytes=0)
            self.files.append(h5)
            h5.create_dataset("x", (0, width), maxshape=(None, width), dtype=self.dtype, chunks=(rows, width), **filters)
            h5.create_dataset("index", (0,), maxshape=(None,), dtype=np.int64, chunks=(rows,), **filters)

    def write(self, block: np.ndarray) -> None:
        if not self.files:
            self._open()
        n, shards, rows = len(block), self.cfg.shards, self.chunk_rows
        if n == shards * rows:  # a whole block: shard k takes rows k*rows .. (k+1)*rows - 1, one chunk
            for k in range(shards):
                self._append(k, block[k * rows:(k + 1) * rows], self.rows + k * rows + np.arange(rows))
        else:  # the last block: dealt round-robin, so shard sizes differ by at most one
            for k in range(min(n, shards)):
                self._append(k, np.ascontiguousarray(block[k::shards]), self.rows + np.arange(k, n, shards))
        self.rows += n

    def _append(self, k: int, x: np.ndarray, index: np.ndarray) -> None:
        h5, pos, m = self.files[k], int(self.sizes[k]), len(x)
        for name, values in (("x", x), ("index", index)):
            h5[name].resize(pos + m, axis=0)
            h5[name][pos:pos + m] = values
        self.sizes[k] = pos + m

    def close(self) -> None:
        for h5 in self.files:
            h5.close()


class _WriteBehind:
    """Calls `write(split, block)` on a thread of its own, at most QUEUE_BLOCKS blocks behind `put`. After a
    failure it drains what is still sent without writing, so `put` never blocks for good; `close` re-raises."""

    def __init__(self, writers: dict[str, _SplitWriter]):
        self._queue: queue.Queue[tuple[str, np.ndarray] | None] = queue.Queue(QUEUE_BLOCKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(writers,), name="hpctrain-token-writer", daemon=True)
        self._thread.start()

    def _run(self, writers: dict[str, _SplitWriter]) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    writers[item[0]].write(item[1])
                except BaseException as exc:  # re-raised on the packing thread by put or close
                    self._error = exc

    def put(self, split: str, block: np.ndarray) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((split, block))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _counted(docs: Iterator[tuple[str, Document]],
             counts: dict[str, dict[str, int]]) -> Iterator[tuple[str, Document]]:
    """The documents as they are, counting documents and text bytes per split on the way."""
    def pieces(split: str, doc: Document) -> Iterator[bytes]:
        for piece in doc:
            counts[split]["text_bytes"] += len(piece)
            yield piece

    for split, doc in docs:
        counts[split]["documents"] += 1
        yield split, pieces(split, doc)


def write_token_shards(cfg: ShardConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Tokenize, pack and shard `cfg.source` into `cfg.out`; return the manifest. `tokenizer` overrides
    `cfg.tokenizer` (one already loaded or trained). Raises ConfigError or DataError naming the bad value."""
    out = cfg.out
    if out.exists() and not cfg.force:
        raise ConfigError(f"OUT {str(out)!r} already exists: choose another directory or pass --force to replace it")
    if out.exists() and not safe_to_replace(out):
        raise ConfigError(f"OUT {str(out)!r} exists and is not an hpctrain dataset; refusing to replace it even with --force")
    if text_form(cfg.source) is None:
        raise ConfigError(f"SOURCE {cfg.source!r} is not text: use one of {TEXT_FORMS}")
    training = cfg.train_tokenizer and tokenizer is None
    tok = tokenizer if tokenizer is not None or training else load_tokenizer(cfg.tokenizer)
    docs = open_documents(cfg.source, glob=cfg.glob, field=cfg.text_field)
    created = [p for p in [*out.parents][::-1] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        if training:  # on the training documents only: nothing of val leaks into the vocabulary
            tok = train_bpe(_train_only(open_documents(cfg.source, glob=cfg.glob, field=cfg.text_field),
                                        cfg.val_fraction), cfg.train_tokenizer, tmp / TOKENIZER_FILE)
        elif getattr(tok, "path", None) is not None:  # the data carries its tokenizer: generate needs it
            shutil.copyfile(tok.path, tmp / TOKENIZER_FILE)
        try:
            result = _write(cfg, tok, docs, tmp)
        except OSError as exc:
            raise DataError(f"writing token shards into {str(tmp)!r} failed: {exc}") from exc
        manifest = lm_manifest(cfg, tok, *result)
        write_manifest(tmp, manifest, cfg.fsync)
        commit(tmp, out, cfg.fsync)
    except BaseException:
        discard_partial(tmp, created)
        raise
    return manifest


def _train_only(docs: Iterator[Document], val_fraction: float) -> Iterator[Document]:
    """The training documents of `docs` (each val document is read through and left out)."""
    for split, doc in split_documents(docs, val_fraction):
        if split == "train":
            yield doc
        else:
            for _ in doc:
                pass


def _write(cfg: ShardConfig, tok: Tokenizer, docs: Iterator[Document],
           tmp: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """Write the shard files of both splits into `tmp`; return (chunk_rows, per split: counts, sizes, sha256s)."""
    dtype = token_dtype(tok.vocab_size)
    chunk_rows = chunk_rows_for(cfg, (cfg.seq_len + 1) * dtype.itemsize)
    writers = {split: _SplitWriter(tmp / split, cfg, dtype, chunk_rows) for split in SPLITS}
    packers = {split: Packer(cfg.seq_len, dtype, cfg.shards * chunk_rows) for split in SPLITS}
    counts = {split: {"documents": 0, "text_bytes": 0} for split in SPLITS}
    behind = _WriteBehind(writers)
    try:
        try:
            for split, ids in tokenize_tagged(_counted(split_documents(docs, cfg.val_fraction), counts), tok):
                for block in packers[split].add(ids):
                    behind.put(split, block)
            for split in SPLITS:
                last = packers[split].finish()
                if last is not None:
                    behind.put(split, last)
        finally:
            behind.close()
    finally:
        for w in writers.values():
            w.close()
    check_val_split(cfg.val_fraction, sum(c["documents"] for c in counts.values()), counts["val"]["documents"])
    _check_rows(cfg, {split: packers[split].stats for split in SPLITS})
    live = [f"{split}/{shard_name(k, cfg.shards)}" for split in SPLITS if writers[split].rows for k in range(cfg.shards)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(live), os.cpu_count() or 1))) as pool:
        digests = dict(zip(live, pool.map(lambda rel: hash_and_sync(tmp / rel, cfg.fsync), live)))
    splits = {split: {**counts[split], "stats": packers[split].stats, "sizes": writers[split].sizes,
                      "sha256": [digests.get(f"{split}/{shard_name(k, cfg.shards)}") for k in range(cfg.shards)]}
              for split in SPLITS}
    return chunk_rows, splits


def _check_rows(cfg: ShardConfig, stats: dict[str, PackStats]) -> None:
    """Every written split has a row in every shard, and train has rows at all."""
    fix = f"use a smaller --seq-len (now {cfg.seq_len}), fewer --shards (now {cfg.shards}) or more text"
    if stats["train"].rows == 0:
        raise DataError(f"{cfg.source!r} gives {stats['train'].tokens} train tokens, not one row of seq_len + 1 = "
                        f"{cfg.seq_len + 1}: {fix}")
    if stats["val"].tokens and stats["val"].rows == 0:  # val documents, too short to make a row: no val split
        raise DataError(f"the val split of {cfg.source!r} gives {stats['val'].tokens} tokens, not one row of seq_len "
                        f"+ 1 = {cfg.seq_len + 1}: use a smaller --seq-len (now {cfg.seq_len}), a larger --val-fraction "
                        f"(now {cfg.val_fraction:g}), or --val-fraction 0 for no val split")
    for split, s in stats.items():
        if 0 < s.rows < cfg.shards:
            raise DataError(f"the {split} split of {cfg.source!r} packs into {s.rows} rows, fewer than --shards "
                            f"{cfg.shards}: {fix}")


def lm_manifest(cfg: ShardConfig, tok: Tokenizer, chunk_rows: int,
                splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest: `sharding`'s entries (so `load_manifest` reads it; `num_classes` is the vocabulary, the
    classes of each next-token prediction) plus `task`, `vocab_size`, `seq_len`, `eot_id`, `tokenizer` and,
    per split, `documents`, `text_bytes` (UTF-8 bytes of its text), `tokens` (its documents' tokens, one EOT
    each included), `target_tokens` (rows * seq_len: the tokens a model predicts) and `dropped_tokens` (the
    tail that filled no row). Bits per byte of a split: mean loss per token (nats) * tokens / text_bytes / ln 2."""
    dtype = token_dtype(tok.vocab_size)
    rows = {split: int(body["stats"].rows) for split, body in splits.items()}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": LM_VERSION,
        "task": TASK,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": cfg.source,
        "val_fraction": cfg.val_fraction,
        "split_rule": "document i is val when floor((i + 1) * val_fraction) > floor(i * val_fraction)",
        "num_shards": cfg.shards,
        "num_classes": tok.vocab_size,
        "num_samples": sum(rows.values()),
        "x": {"dtype": dtype.name, "shape": [cfg.seq_len + 1]},
        "chunk_rows": chunk_rows,
        "compression": cfg.hdf5_compression,
        "fletcher32": True,
        "vocab_size": tok.vocab_size,
        "seq_len": cfg.seq_len,
        "eot_id": tok.eot_id,
        "tokenizer": {"name": tok.name, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
        "packing": "each document's tokens then EOT, joined; row r = tokens[r * seq_len : r * seq_len + seq_len + 1]; "
                   "inputs row[:-1], targets row[1:]; the tail short of a row dropped",
        "splits": {},
    }
    if getattr(tok, "path", None) is not None:  # copied beside the shards by write_token_shards
        manifest["tokenizer"]["file"] = TOKENIZER_FILE
    for split, body in splits.items():
        if not rows[split]:
            continue
        s: PackStats = body["stats"]
        manifest["splits"][split] = {
            "samples": rows[split], "documents": body["documents"], "text_bytes": body["text_bytes"],
            "tokens": s.tokens, "target_tokens": s.rows * cfg.seq_len, "dropped_tokens": s.dropped_tokens,
            "shards": [{"file": f"{split}/{shard_name(k, cfg.shards)}", "samples": int(body["sizes"][k]),
                        "sha256": body["sha256"][k]} for k in range(cfg.shards)],
        }
    return manifest
