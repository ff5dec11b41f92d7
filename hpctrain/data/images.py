"""Images for `hpctrain shard`: decoding one image and fitting it to uint8 (C, H, W), the worker processes
that decode them, and the pipeline that turns encoded images (files or bytes, listed by `imagesets` for
imagefolder:DIR and a Parquet image column) into a checked `Source` the writer streams.

Images are stored as uint8 (N, C, H, W). The manifest's "normalize_on_read" entry (scale 1/255 and the
per-channel mean and std of the stored pixels, counted exactly over all of them) tells the reader how to
make float32, so `train` needs no flag.

Image files are decoded in worker processes started by forkserver (never a fork of a process that may hold
MPI or threads), a chunk of images per task, a bounded number of tasks in flight. Before anything is
written, `image_source` reads every header (sizes and modes: the stored shape; skipped when --image-size and
--channels fix it) and decodes every image once: that finds corrupt files (named; skipped with --skip-bad)
and gives the mean and std. `read(start, stop)` decodes those rows again while the writer streams them, the
next chunk decoding while the writer stores this one; a dataset whose pixels fit in `_KEEP_BYTES` keeps the
first pass's pixels instead (one decode). Memory stays bounded by that or a couple of read chunks.
"""

from __future__ import annotations

import io
import math
import re
import sys
import warnings
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..base.config import ShardConfig
from ..base.errors import ConfigError, DataError, HpctrainError
from ..base.progress import Progress
from .shardformat import NORMALIZE_ON_READ
from .sources import Source
from ..base.threads import worker_context

_GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
_SCALE = 1.0 / 255.0
_KEEP_BYTES = 256 << 20  # decoded pixels up to this size are kept from the checking pass (no second decode)
_TASK_MAX = 64  # images per worker task, at most
_PROGRESS_FROM = 10_000  # images: below this the checking pass shows a bar only on a terminal (stderr stays quiet)


def parse_image_size(text: str | None) -> tuple[int, int] | None:
    """`--image-size` H or HxW as (H, W); None when not given."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)(?:x(\d+))?", str(text).strip().lower())
    size = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if min(size) < 1:
        raise ConfigError(f"--image-size {text!r} must be H or HxW in pixels, e.g. --image-size 224 or --image-size 32x48")
    return size


# ---------------------------------------------------------------------------------------------------
# Decoding one image (runs in the worker processes)
# ---------------------------------------------------------------------------------------------------

def _open(item: Any) -> Any:
    from PIL import Image

    if item is None:
        raise ValueError("no image bytes")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(item))
    return Image.open(item)


def error_text(exc: BaseException) -> str:
    """Why `exc` happened, in one line, for an error that names the file."""
    text = " ".join(str(exc).split()) or "unreadable"
    return f"{type(exc).__name__}: {text[:200]}"


def fit_image(img: Any, channels: int, size: tuple[int, int] | None) -> np.ndarray:
    """One image as uint8 (C, H, W): converted to grayscale (C=1) or RGB (C=3); with `size` (H, W), scaled
    (bilinear) so that it covers H x W and center-cropped to it, like torchvision's Resize + CenterCrop."""
    from PIL import Image

    mode = "L" if channels == 1 else "RGB"
    if size is not None:
        h, w = size
        scale = max(h / img.height, w / img.width)
        # JPEG can decode at 1/2, 1/4, 1/8 scale for free; draft keeps the result at least the cover size.
        img.draft(mode, (max(w, round(img.width * scale)), max(h, round(img.height * scale))))
    if img.mode != mode:
        img = img.convert(mode)
    if size is not None:
        scale = max(h / img.height, w / img.width)
        cover = (max(w, round(img.width * scale)), max(h, round(img.height * scale)))
        if cover != img.size:
            img = img.resize(cover, Image.Resampling.BILINEAR)
        left, top = (cover[0] - w) // 2, (cover[1] - h) // 2
        if (left, top, cover) != (0, 0, (w, h)):
            img = img.crop((left, top, left + w, top + h))
    a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _scan(items: list[Any]) -> list[tuple[int, int, str] | str]:
    """(width, height, mode) of each image from its header alone, or why it cannot be opened."""
    out: list[tuple[int, int, str] | str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for item in items:
            try:
                with _open(item) as img:
                    out.append((img.width, img.height, img.mode))
            except Exception as exc:  # Pillow raises many types for bad files
                out.append(error_text(exc))
    return out


def _decode(items: list[Any], shape: tuple[int, int, int], size: tuple[int, int] | None, keep: bool,
            count: bool) -> tuple[np.ndarray | None, np.ndarray | None, list[tuple[int, str]]]:
    """Decode `items` into uint8 rows of `shape`: (rows if keep, per-channel histogram of the good rows if
    count, [(position, why)] of the images that failed; their rows stay zero)."""
    x = np.zeros((len(items), *shape), np.uint8)
    hist = np.zeros((shape[0], 256), np.int64) if count else None
    bad: list[tuple[int, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, item in enumerate(items):
            try:
                with _open(item) as img:
                    a = fit_image(img, shape[0], size)
                if a.shape != shape:
                    raise ValueError(f"decodes to {a.shape[2]}x{a.shape[1]} pixels, not {shape[2]}x{shape[1]}")
            except Exception as exc:
                bad.append((i, error_text(exc)))
                continue
            x[i] = a
            if hist is not None:
                for c in range(shape[0]):
                    hist[c] += np.bincount(a[c].ravel(), minlength=256)
    return (x if keep else None), hist, bad


# ---------------------------------------------------------------------------------------------------
# Worker pool and the shared image pipeline (imagefolder, Parquet image columns)
# ---------------------------------------------------------------------------------------------------

def _workers(requested: int) -> int:
    """--workers (`sharding.shard` turns 0 into the CPUs this rank owns; a direct caller's 0 is one process)."""
    return max(1, requested)


def _pool(workers: int) -> ProcessPoolExecutor:
    ctx = worker_context(["hpctrain.data.images", "PIL.Image", "PIL.PngImagePlugin", "PIL.JpegImagePlugin"])
    return ProcessPoolExecutor(workers, mp_context=ctx)


def _result(job: Any) -> Any:
    """The value of a submitted task (a Future) or of a deferred one (a zero-argument callable)."""
    try:
        return job.result() if isinstance(job, Future) else job()
    except BrokenProcessPool as exc:
        raise HpctrainError(f"an image decoding worker died ({exc}); out of memory? retry with fewer --workers") from None


def _imap(pool: ProcessPoolExecutor | None, fn: Callable[..., Any], tasks: Iterable[tuple], window: int) -> Iterator[Any]:
    """fn(*task) for every task, in order, with at most `window` tasks in flight."""
    if pool is None:
        for task in tasks:
            yield fn(*task)
        return
    pending: deque[Future] = deque()
    for task in tasks:
        pending.append(pool.submit(fn, *task))
        if len(pending) >= window:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _pieces(ids: np.ndarray, rows: int) -> list[np.ndarray]:
    return [ids[s:s + rows] for s in range(0, len(ids), rows)]


def _task_rows(n: int, workers: int) -> int:
    """Images per task: about 4 tasks per worker (so uneven images still balance), at most _TASK_MAX."""
    return max(1, min(_TASK_MAX, -(-n // (4 * workers))))


@dataclass(slots=True)
class Images:
    """Encoded images by position: `get(lo, hi)` gives items lo..hi-1 (paths or bytes), asked for in
    increasing order; `where(i)` is how an error names image i."""

    n: int
    labels: np.ndarray
    get: Callable[[int, int], list[Any]]
    where: Callable[[int], str]

    def select(self, ids: np.ndarray) -> list[Any]:
        lo = int(ids[0])
        items = self.get(lo, int(ids[-1]) + 1)
        return items if len(items) == len(ids) else [items[int(i) - lo] for i in ids]


def _drop_bad(bad: list[tuple[int, str]], images: Images, cfg: ShardConfig, skipped: list[str]) -> None:
    if not bad:
        return
    first, why = bad[0]
    if not cfg.skip_bad:
        more = f" ({len(bad)} unreadable images in all)" if len(bad) > 1 else ""
        raise DataError(f"cannot read image {images.where(first)!r} ({why}){more}: replace or remove it, "
                        "or pass --skip-bad to skip unreadable images")
    skipped.extend(images.where(i) for i, _ in bad)


def pixel_normalization(hist: np.ndarray, n: int, cfg: ShardConfig) -> dict[str, Any]:
    """{"normalize_on_read": scale 1/255 and the exact per-channel mean and std of x * scale} from pixel-value
    histograms; nothing with --normalize, whose writer stores float32 already normalized per feature."""
    if getattr(cfg, "normalize", "none") != "none":
        return {}
    values = np.arange(256, dtype=np.float64) * _SCALE
    total = hist.sum(axis=1).astype(np.float64)
    mean = hist @ values / total
    std = np.sqrt(np.maximum(hist @ values**2 / total - mean**2, 0.0))
    std = np.where(std > 1e-6, std, 1.0)  # a flat channel: only shift it
    return {NORMALIZE_ON_READ: {
        "scale": _SCALE, "mean": [round(float(m), 6) for m in mean], "std": [round(float(s), 6) for s in std],
        "computed": f"per-channel mean and std of x * scale over all {n} stored images, "
                    "so the reader feeds (x * scale - mean[c]) / std[c]"}}


def image_source(spec: str, images: Images, cfg: ShardConfig, size: tuple[int, int] | None,
                 meta: dict[str, Any]) -> Source:
    """A Source of `images`, checked before it is returned (every header read, every image decoded once),
    whose `read` keeps or decodes again the rows as the module docstring says."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise DataError(f"{spec!r} holds images and decoding them needs Pillow: pip install pillow") from None
    workers = _workers(cfg.workers)
    pool = _pool(workers) if workers > 1 and images.n > _task_rows(images.n, workers) else None
    try:
        return _check_and_stream(spec, images, cfg, size, meta, workers, pool)
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        raise


def _check_and_stream(spec: str, images: Images, cfg: ShardConfig, size: tuple[int, int] | None,
                      meta: dict[str, Any], workers: int, pool: ProcessPoolExecutor | None) -> Source:
    window = 2 * workers
    ids = np.arange(images.n)
    skipped: list[str] = []
    show = sys.stderr.isatty() or images.n >= _PROGRESS_FROM
    if size is not None and cfg.channels:
        # 1. Nothing to learn from the headers: the shape is given.
        channels, good = cfg.channels, []
    else:
        # 1. Headers only (no pixel decoding): sizes and modes, files that are not images at all.
        heads: list[tuple[int, int, str] | str] = []
        with Progress(images.n, f"scan {spec}", enabled=show, unit="images") as bar:
            for part in _imap(pool, _scan, ((images.select(p),) for p in _pieces(ids, _task_rows(images.n, workers))),
                             window):
                heads += part
                bar.update(len(part))
        _drop_bad([(i, h) for i, h in enumerate(heads) if isinstance(h, str)], images, cfg, skipped)
        ids = np.array([i for i, h in enumerate(heads) if not isinstance(h, str)], np.int64)
        if len(ids) == 0:
            raise DataError(f"no readable image in {spec!r} ({len(skipped)} skipped): check the files")
        good = [heads[i] for i in ids]
        channels = cfg.channels or (1 if all(h[2] in _GRAY_MODES for h in good) else 3)
    if size is None:
        w0, h0 = good[0][:2]
        odd = [int(i) for i, h in zip(ids, good) if h[:2] != (w0, h0)]
        if odd:
            w1, h1 = heads[odd[0]][:2]
            raise DataError(f"images in {spec!r} differ in size: {images.where(int(ids[0]))!r} is {h0}x{w0} (HxW) but "
                            f"{images.where(odd[0])!r} is {h1}x{w1} ({len(odd)} of {len(ids)} images differ from the first): pass "
                            "--image-size H or HxW to resize and center-crop them all")
        size_hw = (h0, w0)
    else:
        size_hw = size
    shape = (channels, *size_hw)

    # 2. Decode every image once: corrupt data, and the pixel histogram for the normalization.
    keep = len(ids) * math.prod(shape) <= _KEEP_BYTES
    kept = np.empty((len(ids), *shape), np.uint8) if keep else None
    hist = np.zeros((channels, 256), np.int64)
    bad: list[tuple[int, str]] = []
    pieces = _pieces(ids, _task_rows(len(ids), workers))
    tasks = ((images.select(p), shape, size, keep, True) for p in pieces)
    with Progress(len(ids), f"check {spec}", enabled=show, unit="images") as bar:
        pos = 0
        for p, (x, h, b) in zip(pieces, _imap(pool, _decode, tasks, window)):
            if kept is not None:
                kept[pos:pos + len(p)] = x
            hist += h
            bad += [(int(p[j]), why) for j, why in b]
            pos += len(p)
            bar.update(len(p))
    _drop_bad(bad, images, cfg, skipped)
    if bad:
        mask = ~np.isin(ids, [i for i, _ in bad])
        ids = ids[mask]
        kept = kept[mask] if kept is not None else None
        if len(ids) == 0:
            raise DataError(f"no readable image in {spec!r} ({len(skipped)} skipped): check the files")

    meta = dict(meta)
    meta["images"] = {"channels": channels, "height": shape[1], "width": shape[2],
                      "resize": ("scaled (bilinear) to cover HxW, then center-cropped" if size else
                                 "none (every image has this size)")}
    meta.update(pixel_normalization(hist, len(ids), cfg))
    if cfg.skip_bad:
        meta["skipped"] = len(skipped)
        meta["skipped_files"] = skipped

    if kept is not None:
        if pool is not None:
            pool.shutdown(wait=True)
        return Source(spec, len(ids), shape, np.dtype(np.uint8), images.labels[ids], lambda s, e: kept[s:e], meta)
    read, close = _streaming_read(images, ids, shape, size, workers, pool)
    return Source(spec, len(ids), shape, np.dtype(np.uint8), images.labels[ids], read, meta, close)


def _streaming_read(images: Images, ids: np.ndarray, shape: tuple[int, int, int],
                    size: tuple[int, int] | None, workers: int,
                    pool: ProcessPoolExecutor | None) -> tuple[Callable[[int, int], np.ndarray], Callable[[], None]]:
    """read(start, stop) decoding rows in the workers; the chunk after it is submitted before returning,
    so it decodes while the writer stores this one (the writer reads in increasing, equal chunks)."""
    n = len(ids)
    ahead: dict[tuple[int, int], list[tuple[np.ndarray, Any]]] = {}

    def submit(start: int, stop: int) -> list[tuple[np.ndarray, Any]]:
        jobs = []
        for p in _pieces(ids[start:stop], _task_rows(stop - start, workers)):
            items = images.select(p)
            if pool is None:
                jobs.append((p, lambda items=items: _decode(items, shape, size, True, False)))
            else:
                jobs.append((p, pool.submit(_decode, items, shape, size, True, False)))
        return jobs

    def read(start: int, stop: int) -> np.ndarray:
        jobs = ahead.pop((start, stop), None)
        for stale in ahead.values():
            for _, job in stale:
                if isinstance(job, Future):
                    job.cancel()
        ahead.clear()
        if jobs is None:
            jobs = submit(start, stop)
        if pool is not None and stop < n:
            nxt = (stop, min(n, stop + (stop - start)))
            ahead[nxt] = submit(*nxt)
        parts = []
        for p, job in jobs:
            x, _, bad = _result(job)
            if bad:
                i, why = bad[0]
                raise DataError(f"cannot read image {images.where(int(p[i]))!r} ({why}); it changed after "
                                "hpctrain checked it: keep the source unchanged while `shard` runs")
            parts.append(x)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def close() -> None:
        ahead.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    return read, close
