"""The per-rank reader of a shard set (the format, its manifest and checks: `shardformat`).

Rank r of W reads shards r, r+W, r+2W, ... and nothing else. Every rank knows the sample count of every
shard from the manifest, so all ranks agree on the number of steps of an epoch without talking; a rank
whose shards hold fewer samples gets a short (or empty) last batch instead of hanging the others in an
allreduce, and every sample is still used exactly once per epoch.

Reading is block-wise (contiguous h5py slices, never per-sample indexing). With shuffling, the blocks of
the rank's shards are permuted and gathered into windows; the samples of each window are permuted again.
A window holds up to `window_rows` samples (all of them for small datasets, so the shuffle is then a full
uniform permutation). The order is a pure function of (seed, epoch, rank, world size).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..base.errors import DataError
from .hdf5env import reader_locking
from .shardformat import ShardFile, ShardSet
from ..base.threads import join_logged

JOIN_TIMEOUT_S = 10.0  # how long closing a reader waits for its threads before leaving them (logged)


def _refs(bufs: dict[str, np.ndarray]) -> int:
    """The most references any array of a window buffer has: every view of an array references it (numpy
    points a view of a view at the owner too), so only the pool's own and this call's remain when none is
    alive."""
    return max(sys.getrefcount(a) for a in bufs.values())


_FREE_REFS = _refs({"x": np.empty(1)})  # measured as the pool measures: a dict's array that nothing else holds
WINDOWS_IN_USE = 4  # the most window buffers a reading-ahead epoch holds at once (`_window_buffers`)


def _geometry(shardset: ShardSet, block_rows: int | None = None, window_rows: int | None = None) -> tuple[int, int]:
    """(rows of a block, rows of a shuffle window) of a reader of `shardset`."""
    # blocks of about 2 MiB: large enough that h5py's per-read cost is small, small enough to shuffle well
    block = block_rows or int(min(8192, max(64, (2 << 20) // shardset.row_bytes)))
    # a shuffle window holds up to 64 MiB of samples (at most 65,536 of them)
    return block, max(window_rows or min(1 << 16, (64 << 20) // shardset.row_bytes), block)


def planned_bytes(shardset: ShardSet, world: int) -> int:
    """The most memory one rank's readers hold, as `train` reads (the memory plan's `data`): the training
    split's window buffers (one when the rank's part fits in one window, else up to `WINDOWS_IN_USE`), the
    validation split's (read without read-ahead: up to three), and the labels and ids of every shard the rank
    reads, which are loaded whole."""
    labels = 8 * (len(shardset.datasets()) - 1)  # int64 y and index per sample (token rows: index only)
    row = shardset.row_bytes + labels
    _, window = _geometry(shardset)
    total = 0
    for split, most in (("train", WINDOWS_IN_USE), ("val", WINDOWS_IN_USE - 1)):
        if split not in shardset.splits:
            continue
        samples = max(sum(f.samples for f in shardset.rank_shards(split, r, world)) for r in range(world))
        buffers = 1 if samples <= window else most
        total += buffers * min(samples, window) * row + labels * samples
    return total


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch: x and y as train feeds them (for token rows, lm: x = row[:-1], y = row[1:], both int64)."""

    x: np.ndarray
    y: np.ndarray
    index: np.ndarray  # global sample ids, for --audit-samples


class ShardReader:
    """Batches of one split for one rank, in a deterministic order per epoch.

    `steps_per_epoch` is the same on every rank: the most batches any rank needs. `step_sizes(step)` gives
    every rank's batch size at a step, so the caller can weight each rank's gradient by its share of the
    global batch.
    """

    def __init__(self, shardset: ShardSet, split: str, *, rank: int, world: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0, block_rows: int | None = None,
                 window_rows: int | None = None, prefetch: int = 2, exclude: np.ndarray | None = None,
                 segment: int = 0):
        shardset.check_world(world)
        self.shardset = shardset
        self.split = split
        self.rank = rank
        self.world = world
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.files = shardset.rank_shards(split, rank, world)
        self.counts = np.array([sum(f.samples for f in shardset.rank_shards(split, r, world)) for r in range(world)])
        # Elastic resume: the rest of an epoch started on another world size. `exclude` holds the ids already
        # trained on this epoch; `segment` numbers the world-size changes inside the epoch (it salts the order).
        self._salt = [segment] if segment else []
        self._keep: dict[int, np.ndarray] | None = None
        if exclude is not None and len(exclude):
            self._keep, self.counts = self._exclusion(np.unique(exclude))
        self.samples = int(self.counts[rank])
        self.steps_per_epoch = int(max(0, -(-int(self.counts.max()) // batch_size)))
        self.block_rows, self.window_rows = _geometry(shardset, block_rows, window_rows)
        self.prefetch = prefetch
        self._handles: dict[Path, Any] = {}
        self._datasets: dict[tuple[Path, str], Any] = {}
        self._pid = os.getpid()
        self._active: weakref.WeakSet[Any] = weakref.WeakSet()  # epochs being read (closed by close())
        self._pool: list[dict[str, np.ndarray]] = []  # window buffers (`_window_buffers`)
        self._pool_rows = 0
        # `_whole`: the held blocks in the order read, each block's first row there, and the rows
        self._held: tuple[list[tuple[int, int, int]], dict[tuple[int, int], int], tuple[np.ndarray, ...]] | None = None

    def _exclusion(self, exclude: np.ndarray) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """Keep masks of this rank's files and every rank's remaining sample count."""
        import h5py

        counts, masks = [], {}
        for r in range(self.world):
            n = 0
            for i, f in enumerate(self.shardset.rank_shards(self.split, r, self.world)):
                with h5py.File(f.path, "r", locking=reader_locking()) as h5:
                    ids = h5["index"][()]
                pos = np.searchsorted(exclude, ids).clip(max=len(exclude) - 1)
                keep = exclude[pos] != ids
                n += int(keep.sum())
                if r == self.rank:
                    masks[i] = keep
            counts.append(n)
        return masks, np.array(counts)

    def _kept(self, blocks: list[tuple[int, int, int]]) -> np.ndarray | None:
        if self._keep is None:
            return None
        return np.concatenate([self._keep[i][a:b] for i, a, b in blocks]) if blocks else np.zeros(0, bool)

    def step_sizes(self, step: int) -> np.ndarray:
        """Every rank's number of samples at `step` of an epoch (0 once a rank has run out)."""
        start = step * self.batch_size
        return np.clip(self.counts - start, 0, self.batch_size)

    # -- planning: pure functions of (seed, epoch, rank, world) --------------------------------------
    def _blocks(self) -> list[tuple[int, int, int]]:
        blocks = []
        for i, f in enumerate(self.files):
            for start in range(0, f.samples, self.block_rows):
                blocks.append((i, start, min(f.samples, start + self.block_rows)))
        return blocks

    def _windows(self, epoch: int) -> list[tuple[list[tuple[int, int, int]], int]]:
        """(blocks of the window, seed of its in-window permutation) in stream order."""
        blocks = self._blocks()
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, self.rank, self.world, 0, *self._salt])
            order = [blocks[i] for i in rng.permutation(len(blocks))]
        else:
            order = blocks
        windows, current, rows = [], [], 0
        for b in order:
            if current and rows + (b[2] - b[1]) > self.window_rows:
                windows.append(current)
                current, rows = [], 0
            current.append(b)
            rows += b[2] - b[1]
        if current:
            windows.append(current)
        return [(w, i) for i, w in enumerate(windows)]

    def _open(self, f: ShardFile) -> Any:
        import h5py

        if self._pid != os.getpid():
            # a forked worker: never use the parent's HDF5 handles; open our own
            self._handles, self._datasets, self._pid = {}, {}, os.getpid()
        handle = self._handles.get(f.path)
        if handle is None:
            try:
                handle = h5py.File(f.path, "r", locking=reader_locking())
            except OSError as exc:
                raise DataError(f"cannot open shard {str(f.path)!r} ({exc}); check it with `hpctrain verify`") from exc
            self._handles[f.path] = handle
            try:  # look x up once (h5py's lookup costs more than a small read); y and index are small: read whole
                self._datasets[(f.path, "x")] = handle["x"]
                for name in self.shardset.datasets()[1:]:
                    self._datasets[(f.path, name)] = handle[name][()].astype(np.int64, copy=False)
            except KeyError as exc:
                raise DataError(f"shard {str(f.path)!r} lacks dataset {exc}; re-create it with `hpctrain shard`") from exc
            except OSError as exc:
                raise DataError(f"cannot read y/index of shard {str(f.path)!r} ({exc}); the file is corrupt: check it "
                                "with `hpctrain verify` and re-create it with `hpctrain shard`") from exc
        return handle

    @staticmethod
    def _bad_chunk(h5: Any, start: int, stop: int) -> int | str:
        """The first chunk in rows start:stop that fails its checksum (read chunk by chunk to find it)."""
        for name in ("x", "y", "index"):
            try:
                rows = h5[name].chunks[0]
                for lo in range((start // rows) * rows, stop, rows):
                    try:
                        h5[name][lo:min(lo + rows, stop)]
                    except OSError:
                        return f"{lo // rows} of {name!r}"
            except (KeyError, TypeError):
                continue
        return "?"

    def _read(self, blocks: list[tuple[int, int, int]], only_indices: bool = False) -> tuple[np.ndarray, ...]:
        """The rows of `blocks`, in block order, read straight into one array per dataset (runs of adjacent
        blocks of one file become one contiguous read)."""
        runs: list[list[int]] = []
        for i, start, stop in blocks:
            if runs and runs[-1][0] == i and runs[-1][2] == start:
                runs[-1][2] = stop
            else:
                runs.append([i, start, stop])
        total = sum(stop - start for _, start, stop in runs)
        names = ("index",) if only_indices else self.shardset.datasets()  # token rows (lm) have no y
        if only_indices:
            out = {"index": np.empty(total, np.int64)}
        else:
            out = self._window_buffers(total)
        offset = 0
        for i, start, stop in runs:
            f = self.files[i]
            h5 = self._open(f)
            n = stop - start
            try:
                for name in names:
                    ds = self._datasets[(f.path, name)]
                    if isinstance(ds, np.ndarray):
                        out[name][offset:offset + n] = ds[start:stop]
                    elif ds.dtype == out[name].dtype:
                        ds.read_direct(out[name], np.s_[start:stop], np.s_[offset:offset + n])
                    else:
                        out[name][offset:offset + n] = ds[start:stop]
            except (OSError, KeyError, TypeError) as exc:
                chunk = self._bad_chunk(h5, start, stop)
                raise DataError(f"cannot read rows {start}:{stop} (HDF5 chunk {chunk}) of shard {str(f.path)!r}: "
                                f"{exc}; the file is corrupt or truncated: check it with `hpctrain verify` and "
                                "re-create it with `hpctrain shard`") from exc
            offset += n
        return (out["index"],) if only_indices else (out["x"], out["y"], out["index"])

    def _window_buffers(self, rows: int) -> dict[str, np.ndarray]:
        """Views of `rows` rows of a window buffer that nothing holds now (the pool grows only when every
        buffer is in use). In use: a view of it is alive, in the window being read, the one waiting in the
        read-ahead queue, or the one or two a batch is gathered from (batches are copies): at most four.
        Fresh memory costs more than the read (first touching a window is many times slower than reading it
        into used memory: `hpctrain bench data`, `first_batch_ms`), so a buffer is reused as soon as it is
        free, and a data set of one window per epoch holds one."""
        if rows > self._pool_rows:
            self._pool_rows, self._pool = rows, []  # larger windows: a fresh pool (the old one is dropped)
        bufs = next((b for b in self._pool if _refs(b) <= _FREE_REFS), None)
        if bufs is None:
            bufs = {"x": np.empty((self._pool_rows, *self.shardset.x_shape), np.dtype(self.shardset.x_dtype)),
                    "y": np.empty(self._pool_rows, np.int64), "index": np.empty(self._pool_rows, np.int64)}
            self._pool.append(bufs)
        return {name: b[:rows] for name, b in bufs.items()}

    def _stream(self, epoch: int, skip: int) -> Iterator[list[Any]]:
        """Windows [x, y, index, order, cursor, where] in stream order; `order` is the in-window permutation
        (None: file order); `where` maps the window's rows to the held rows (`_whole`; None: they are the same);
        the first `skip` samples of the epoch are skipped without reading them."""
        windows = self._windows(epoch)
        for blocks, wseed in windows:
            kept = self._kept(blocks)
            rows = sum(b[2] - b[1] for b in blocks) if kept is None else int(kept.sum())
            if skip >= rows:
                skip -= rows
                continue
            where = None
            if kept is None and len(windows) == 1:
                (x, y, ix), where = self._whole(blocks)
            else:
                x, y, ix = self._read(blocks)
                if kept is not None:
                    x, y, ix = x[kept], y[kept], ix[kept]
            order = None
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, self.rank, self.world, 1, wseed, *self._salt]).permutation(rows)
            yield [x, y, ix, order, skip, where]
            skip = 0

    @property
    def held(self) -> bool:
        """Whether the rank's whole split is held in memory (one window holds it, and an epoch has read it)."""
        return self._held is not None

    def _whole(self, blocks: list[tuple[int, int, int]]) -> tuple[tuple[np.ndarray, ...], np.ndarray | None]:
        """The rank's whole split when one window holds it: read once, at the first epoch that asks, and held.
        Another epoch's window holds the same blocks in another order, so re-reading it would buy nothing but
        a wait at every epoch's first batch. Returns the rows
        as held and `where`: the position there of each row of this window in `blocks`' order (None: the
        same order), so that every batch is the one a fresh read gives, row for row."""
        if self._held is None:
            firsts = np.cumsum([0] + [stop - start for _, start, stop in blocks[:-1]])
            self._held = (list(blocks), {(i, start): int(f) for (i, start, _), f in zip(blocks, firsts)},
                          self._read(blocks))
        held, at, arrays = self._held
        if held == blocks:
            return arrays, None
        return arrays, np.concatenate([np.arange(at[i, start], at[i, start] + stop - start)
                                       for i, start, stop in blocks])

    def _batches(self, epoch: int, start_step: int) -> Iterator[Batch]:
        B = self.batch_size
        stream = self._stream(epoch, start_step * B)
        if self.prefetch > 0:
            stream = _in_background(stream, 1, "hpctrain-read")
        try:
            yield from self._gather(epoch, start_step, stream)
        finally:
            stream.close()  # stops the read-ahead thread now, not when the garbage collector gets to it

    def _gather(self, epoch: int, start_step: int, stream: Iterator[list[Any]]) -> Iterator[Batch]:
        pending: deque[list[Any]] = deque()
        empty = self._batch(np.empty((0, *self.shardset.x_shape), self.shardset.x_dtype), np.empty(0, np.int64),
                            np.empty(0, np.int64))
        for step in range(start_step, self.steps_per_epoch):
            want = int(self.step_sizes(step)[self.rank])
            if want == 0:
                yield empty
                continue
            pieces, got = [], 0
            while got < want:
                if not pending:
                    pending.append(next(stream))
                window = pending[0]
                x, y, ix, order, cursor, where = window
                take = min(want - got, len(x) - cursor)
                # one copy per batch (a slice in file order, a gather when shuffled): window buffers are reused
                if order is None and where is None:
                    sel: Any = slice(cursor, cursor + take)
                    pieces.append((x[sel].copy(), y[sel].copy(), ix[sel].copy()))
                else:  # ascending rows of the window: a faster gather, same batch
                    sel = np.arange(cursor, cursor + take) if order is None else np.sort(order[cursor:cursor + take])
                    if where is not None:  # the held rows (`_whole`)
                        sel = where[sel]
                    pieces.append((x[sel], y[sel], ix[sel]))
                got += take
                window[4] = cursor + take
                if window[4] == len(x):
                    pending.popleft()
            if len(pieces) == 1:
                bx, by, bix = pieces[0]
            else:
                bx, by, bix = (np.concatenate([p[k] for p in pieces]) for k in range(3))
            yield self._batch(bx, by, bix)

    def _batch(self, x: np.ndarray, y: np.ndarray, index: np.ndarray) -> Batch:
        """Rows as train feeds them: normalized features and labels, or token rows cut into inputs and targets."""
        if self.shardset.task == "lm":
            rows = x.astype(np.int64)
            return Batch(rows[:, :-1], rows[:, 1:], index)
        return Batch(self.shardset.normalize_on_read(x), y, index)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """The batches of `epoch` from `start_step` on, made ahead by a background thread (which itself
        gets its windows from a second one, so reading the next window overlaps gathering batches)."""
        if self.prefetch <= 0:
            batches = self._batches(epoch, start_step)
        else:
            batches = _in_background(self._batches(epoch, start_step), self.prefetch, "hpctrain-prefetch")
        self._active.add(batches)
        try:
            yield from batches
        finally:
            batches.close()
            self._active.discard(batches)

    def consumed(self, epoch: int, steps: int) -> np.ndarray:
        """Global ids this rank trained on in the first `steps` steps of `epoch`, as a set (elastic resume)."""
        n = int(min(self.samples, steps * self.batch_size))
        out, need = [], n
        for blocks, wseed in self._windows(epoch):
            if need <= 0:
                break
            (ix,) = self._read(blocks, only_indices=True)
            kept = self._kept(blocks)
            if kept is not None:
                ix = ix[kept]
            if self.shuffle:
                ix = ix[np.random.default_rng([self.seed, epoch, self.rank, self.world, 1, wseed, *self._salt]).permutation(len(ix))]
            out.append(ix[:need])
            need -= len(ix[:need])
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def close(self) -> None:
        """Stop the epochs still being read (their threads are joined first: nothing reads a closed file),
        then close the files. Never blocks for long, whatever was consumed."""
        for batches in list(self._active):
            try:
                batches.close()
            except ValueError:  # running in another thread right now: it stops when that thread closes it
                pass
        self._active.clear()
        self._pool = []
        self._datasets.clear()
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def epoch_remainder(shardset: ShardSet, split: str, segments: list[tuple[int, ...]], *, batch_size: int,
                    shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Ids already trained on in `epoch` by earlier segments [(world size, steps[, batch size]), ...] (a segment
    without its batch size: `batch_size`): the sets each of their ranks consumed, each segment reading what the
    ones before it left. Pure function of its inputs."""
    done = np.empty(0, np.int64)
    for j, (world, steps, *batch) in enumerate(segments):
        parts = [done]
        for r in range(world):
            reader = ShardReader(shardset, split, rank=r, world=world, batch_size=batch[0] if batch else batch_size,
                                 shuffle=shuffle, seed=seed, exclude=done, segment=j, prefetch=0)
            parts.append(reader.consumed(epoch, steps))
            reader.close()
        done = np.concatenate(parts)
    return done


def _in_background(items: Iterator[Any], depth: int, name: str, *, join_timeout: float = JOIN_TIMEOUT_S) -> Iterator[Any]:
    """Iterate `items` in a thread, `depth` items ahead; errors are re-raised here.

    Closing the returned iterator (at any point: after any number of items, or before the first) stops the
    thread and joins it: every wait in the thread is bounded and checks the stop event, and the thread
    closes `items` itself (it is the thread that runs it), so a nested background iterator stops too.
    A thread still busy after `join_timeout` (a read blocked on a hung filesystem) is logged, not waited for.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            put(exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                if thread.is_alive():
                    continue
                try:  # it may have put its last item just before ending
                    item = q.get_nowait()
                except queue.Empty:
                    raise DataError(f"the {name} thread ended without a result; this is a bug, please report it") from None
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        join_logged(thread, join_timeout, "reading ahead")

