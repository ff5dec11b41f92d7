"""Dataset files as users have them on disk, opened as a `Source` for `hpctrain shard`.

The SOURCE forms: `imagefolder:DIR` (one subfolder per class; the class is the subfolder's name, in sorted
order), `mnist:DIR` (the idx files, gzipped or not), `cifar10:DIR` (the python batches) and `FILE.parquet`
(numeric columns, or one column of encoded images, plus a label column). Images are stored as uint8
(N, C, H, W). The manifest's "normalization" (scale 1/255 and the per-channel mean and std of the stored
pixels, counted exactly over all of them) tells the reader how to make float32, so `train` needs no flag.

Image files are decoded in worker processes started by forkserver (never a fork of a process that may hold
MPI or threads), a chunk of images per task, a bounded number of tasks in flight. Before anything is
written, `open_source` reads every header (sizes and modes: the stored shape; skipped when --image-size and
--channels fix it) and decodes every image once: that finds corrupt files (named; skipped with --skip-bad)
and gives the mean and std. `read(start, stop)` decodes those rows again while the writer streams them, the
next chunk decoding while the writer stores this one; a dataset whose pixels fit in `_KEEP_BYTES` keeps the
first pass's pixels instead (one decode). Memory stays bounded by that or a couple of read chunks.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import pickle
import re
import struct
import sys
import warnings
import zlib
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..base.config import ShardConfig
from ..base.rankenv import read_env
from ..base.errors import ConfigError, DataError, HpctrainError
from ..base.progress import Progress
from .sharding import Source, _labels
from ..base.threads import worker_context

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".pbm", ".tif", ".tiff", ".webp")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
_SCALE = 1.0 / 255.0
_KEEP_BYTES = 256 << 20  # decoded pixels up to this size are kept from the checking pass (no second decode)
_TASK_MAX = 64  # images per worker task, at most
_PROGRESS_FROM = 10_000  # images: below this the checking pass shows a bar only on a terminal (stderr stays quiet)
_ARRAY_ROWS = 4096  # rows of an in-memory array converted at a time


def open_source(spec: str, cfg: ShardConfig) -> Source:
    """Open `imagefolder:DIR`, `mnist:DIR`, `cifar10:DIR` or `FILE.parquet` for the writer.

    Everything that can be checked before writing is checked here (layout, headers, every image decoded
    once, idx lengths, batch contents); a problem raises DataError naming the path and the fix.
    """
    size = parse_image_size(cfg.image_size)
    for prefix, opener in (("imagefolder:", _image_folder), ("mnist:", _mnist), ("cifar10:", _cifar10)):
        if spec.startswith(prefix):
            folder = spec[len(prefix):]
            if not folder:
                raise DataError(f"SOURCE {spec!r} names no folder: write {prefix}DIR, e.g. {prefix}data/{prefix[:-1]}")
            return opener(spec, Path(folder), cfg, size)
    return _parquet(spec, Path(spec), cfg, size)


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


def _reason(exc: BaseException) -> str:
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
                out.append(_reason(exc))
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
                bad.append((i, _reason(exc)))
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
    """--workers, or 0: the CPUs this process owns (all it may run on; its share of them under a launcher)."""
    return requested or read_env().torch_threads()


def _pool(workers: int) -> ProcessPoolExecutor:
    ctx = worker_context(["hpctrain.data.imagesources", "PIL.Image", "PIL.PngImagePlugin", "PIL.JpegImagePlugin"])
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
class _Images:
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


def _drop_bad(bad: list[tuple[int, str]], images: _Images, cfg: ShardConfig, skipped: list[str]) -> None:
    if not bad:
        return
    first, why = bad[0]
    if not cfg.skip_bad:
        more = f" ({len(bad)} unreadable images in all)" if len(bad) > 1 else ""
        raise DataError(f"cannot read image {images.where(first)!r} ({why}){more}: replace or remove it, "
                        "or pass --skip-bad to skip unreadable images")
    skipped.extend(images.where(i) for i, _ in bad)


def _normalization(hist: np.ndarray, n: int, cfg: ShardConfig) -> dict[str, Any]:
    """{"normalization": scale 1/255 and the exact per-channel mean and std of x * scale} from pixel-value
    histograms; nothing with --normalize, whose writer stores float32 already normalized per feature."""
    if getattr(cfg, "normalize", "none") != "none":
        return {}
    values = np.arange(256, dtype=np.float64) * _SCALE
    total = hist.sum(axis=1).astype(np.float64)
    mean = hist @ values / total
    std = np.sqrt(np.maximum(hist @ values**2 / total - mean**2, 0.0))
    std = np.where(std > 1e-6, std, 1.0)  # a flat channel: only shift it
    return {"normalization": {
        "scale": _SCALE, "mean": [round(float(m), 6) for m in mean], "std": [round(float(s), 6) for s in std],
        "computed": f"per-channel mean and std of x * scale over all {n} stored images, "
                    "so the reader feeds (x * scale - mean[c]) / std[c]"}}


def _image_source(spec: str, images: _Images, cfg: ShardConfig, size: tuple[int, int] | None,
                  meta: dict[str, Any]) -> Source:
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


def _check_and_stream(spec: str, images: _Images, cfg: ShardConfig, size: tuple[int, int] | None,
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
    meta.update(_normalization(hist, len(ids), cfg))
    if cfg.skip_bad:
        meta["skipped"] = len(skipped)
        meta["skipped_files"] = skipped

    if kept is not None:
        if pool is not None:
            pool.shutdown(wait=True)
        return Source(spec, len(ids), shape, np.dtype(np.uint8), images.labels[ids], lambda s, e: kept[s:e], meta)
    read, close = _streaming_read(images, ids, shape, size, workers, pool)
    return Source(spec, len(ids), shape, np.dtype(np.uint8), images.labels[ids], read, meta, close)


def _streaming_read(images: _Images, ids: np.ndarray, shape: tuple[int, int, int],
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


# ---------------------------------------------------------------------------------------------------
# imagefolder:DIR
# ---------------------------------------------------------------------------------------------------

def _images_under(folder: Path) -> list[str]:
    found = []
    for here, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(here, f) for f in files
                  if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return sorted(found)


def _image_folder(spec: str, root: Path, cfg: ShardConfig, size: tuple[int, int] | None) -> Source:
    layout = f"put the images in one subfolder per class, {root}/CLASS/IMAGE.png"
    if not root.exists():
        raise DataError(f"imagefolder {str(root)!r} not found: check the path")
    if not root.is_dir():
        raise DataError(f"imagefolder {str(root)!r} is not a directory: {layout}")
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if not entries:
        raise DataError(f"imagefolder {str(root)!r} is empty: {layout}")
    classes = sorted(p.name for p in entries if p.is_dir())
    if not classes:
        raise DataError(f"imagefolder {str(root)!r} has no class subfolders: {layout}")
    paths: list[str] = []
    counts = []
    for name in classes:
        found = _images_under(root / name)
        if not found:
            raise DataError(f"class folder {str(root / name)!r} holds no images ({' '.join(IMAGE_EXTENSIONS)}): "
                            "add images or remove the folder")
        paths += found
        counts.append(len(found))
    labels = np.repeat(np.arange(len(classes), dtype=np.int64), counts)
    images = _Images(len(paths), labels, lambda lo, hi: paths[lo:hi], lambda i: paths[i])
    return _image_source(spec, images, cfg, size, {"classes": classes})


# ---------------------------------------------------------------------------------------------------
# Image arrays in files: mnist:DIR, cifar10:DIR
# ---------------------------------------------------------------------------------------------------

def _to_channels(x: np.ndarray, channels: int | None) -> np.ndarray:
    if not channels or channels == x.shape[1]:
        return x
    if channels == 3:
        return np.repeat(x, 3, axis=1)
    # Pillow's RGB -> L (ITU-R 601-2 luma, 16-bit fixed point), so folders and arrays agree.
    w = np.array([19595, 38470, 7471], np.uint32).reshape(1, 3, 1, 1)
    return ((x.astype(np.uint32) * w).sum(axis=1, keepdims=True) + 0x8000 >> 16).astype(np.uint8)


def _convert(x: np.ndarray, channels: int | None, size: tuple[int, int] | None) -> np.ndarray:
    """uint8 rows (k, C, H, W) with --channels and --image-size applied as for image files."""
    from_channels = _to_channels(x, channels)
    if size is None or tuple(from_channels.shape[2:]) == size:
        return from_channels
    from PIL import Image

    c = from_channels.shape[1]
    return np.stack([fit_image(Image.fromarray(r[0] if c == 1 else r.transpose(1, 2, 0)), c, size)
                     for r in from_channels])


def _histogram(x: np.ndarray) -> np.ndarray:
    return np.stack([np.bincount(x[:, c].ravel(), minlength=256) for c in range(x.shape[1])]).astype(np.int64)


Part = tuple[Path, Callable[[], tuple[np.ndarray, np.ndarray]]]


def _array_parts(spec: str, parts: list[Part], cfg: ShardConfig, size: tuple[int, int] | None,
                 meta: dict[str, Any]) -> Source:
    """A Source over image arrays kept in several files (MNIST's train and t10k, CIFAR's batches): each
    loader returns checked uint8 (k, C, H, W) images and their labels; one file is in memory at a time."""
    ys: list[np.ndarray] = []
    files: list[dict[str, Any]] = []
    shape: tuple[int, ...] | None = None
    hist: np.ndarray | None = None
    offset = 0
    for path, load in parts:
        x, y = load()
        for s in range(0, len(x), _ARRAY_ROWS):
            rows = _convert(x[s:s + _ARRAY_ROWS], cfg.channels, size)
            if shape is None:
                shape, hist = rows.shape[1:], np.zeros((rows.shape[1], 256), np.int64)
            elif rows.shape[1:] != shape:
                raise DataError(f"{str(path)!r} holds images of shape {tuple(x.shape[1:])}, unlike {files[0]['file']!r}: "
                                "use files of one dataset, or pass --image-size to bring them to one size")
            hist += _histogram(rows)
        ys.append(_labels(y, str(path)))
        files.append({"file": str(path), "first": offset, "samples": len(x)})
        offset += len(x)
        del x
    assert shape is not None and hist is not None
    bounds = np.cumsum([0] + [f["samples"] for f in files])
    cache: dict[int, np.ndarray] = {}

    def read(start: int, stop: int) -> np.ndarray:
        out = []
        for k in range(len(parts)):
            lo, hi = max(start, bounds[k]), min(stop, bounds[k + 1])
            if lo >= hi:
                continue
            if k not in cache:
                cache.clear()
                cache[k] = parts[k][1]()[0]
            out.append(_convert(cache[k][lo - bounds[k]:hi - bounds[k]], cfg.channels, size))
        return np.concatenate(out) if len(out) > 1 else out[0]

    meta = {**meta, "files": files, "images": {"channels": shape[0], "height": shape[1], "width": shape[2],
                                               "resize": "scaled (bilinear) to cover HxW, then center-cropped"
                                               if size else "none"},
            **_normalization(hist, offset, cfg)}
    return Source(spec, offset, tuple(shape), np.dtype(np.uint8), np.concatenate(ys), read, meta, cache.clear)


def _idx(path: Path, ndim: int) -> np.ndarray:
    """An idx file (MNIST's format; gzipped or not) as a uint8 array, refusing one that is cut short."""
    again = "download it again (and gunzip only whole files)"
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {str(path)!r} ({_reason(exc)}): the file is incomplete or corrupt; {again}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{str(path)!r} is not an idx file (its first bytes are not 00 00 TYPE NDIM): {again}")
    if raw[2] != 0x08:
        raise DataError(f"{str(path)!r} holds idx type 0x{raw[2]:02x}; hpctrain reads unsigned bytes (0x08), as MNIST has")
    if raw[3] != ndim:
        what = "images need 3 (N, rows, cols)" if ndim == 3 else "labels need 1 (N)"
        raise DataError(f"{str(path)!r} has {raw[3]} dimensions, {what}: check the file names")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{str(path)!r} is truncated: {len(raw)} bytes, shorter than its header; {again}")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    want = header + math.prod(dims)
    if len(raw) != want:
        state = "truncated" if len(raw) < want else "longer than its header says"
        raise DataError(f"{str(path)!r} is {state}: its header promises {'x'.join(map(str, dims))} values "
                        f"({want} bytes) but it holds {len(raw)} bytes; {again}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _find_idx(root: Path, stem: str) -> Path | None:
    for name in (stem, stem.replace("-idx", ".idx")):
        for ext in ("", ".gz"):
            if (root / (name + ext)).is_file():
                return root / (name + ext)
    return None


def _mnist(spec: str, root: Path, cfg: ShardConfig, size: tuple[int, int] | None) -> Source:
    if not root.is_dir():
        raise DataError(f"mnist folder {str(root)!r} not found: point mnist: at the folder holding the idx files")
    parts: list[Part] = []
    for prefix in ("train", "t10k"):
        img, lab = _find_idx(root, f"{prefix}-images-idx3-ubyte"), _find_idx(root, f"{prefix}-labels-idx1-ubyte")
        if img is None and lab is None:
            continue
        if img is None or lab is None:
            have, lack = (img or lab), (f"{prefix}-images-idx3-ubyte" if img is None else f"{prefix}-labels-idx1-ubyte")
            raise DataError(f"{str(have)!r} has no partner {lack}[.gz] in {str(root)!r}: download both files of the pair")

        def load(img: Path = img, lab: Path = lab) -> tuple[np.ndarray, np.ndarray]:
            x, y = _idx(img, 3), _idx(lab, 1)
            if len(x) != len(y):
                raise DataError(f"{str(img)!r} holds {len(x)} images but {str(lab)!r} {len(y)} labels: "
                                "they must come from the same release; download them again")
            return x[:, None], y

        parts.append((img, load))
    if not parts:
        raise DataError(f"no MNIST idx files in {str(root)!r}: it needs train-images-idx3-ubyte[.gz] and "
                        "train-labels-idx1-ubyte[.gz] (and optionally the t10k-* pair); see datasets/README.md")
    return _array_parts(spec, parts, cfg, size, {})


class _BatchUnpickler(pickle.Unpickler):
    """Loads CIFAR's python batches (dicts of bytes, lists and numpy arrays) and nothing else: a pickle can
    otherwise run any code."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}  # protocol-2 bytes from Python 3

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of a CIFAR batch)")
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = module.replace("numpy.core", "numpy._core", 1)
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict[Any, Any]:
    try:
        with open(path, "rb") as fh:
            data = _BatchUnpickler(fh, encoding="bytes").load()
    except Exception as exc:  # a damaged pickle can raise nearly anything
        raise DataError(f"cannot read {str(path)!r} as a CIFAR-10 python batch ({_reason(exc)}): "
                        "download and extract cifar-10-python.tar.gz again") from None
    if not isinstance(data, dict):
        raise DataError(f"{str(path)!r} is not a CIFAR-10 python batch (holds a {type(data).__name__}, not a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def _cifar10(spec: str, root: Path, cfg: ShardConfig, size: tuple[int, int] | None) -> Source:
    if not root.is_dir():
        raise DataError(f"cifar10 folder {str(root)!r} not found: point cifar10: at the extracted cifar-10-batches-py")
    base = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
    numbered = sorted((int(m.group(1)), p) for p in base.iterdir() if (m := re.fullmatch(r"data_batch_(\d+)", p.name)))
    batches = [p for _, p in numbered] + ([base / "test_batch"] if (base / "test_batch").is_file() else [])
    if not batches:
        raise DataError(f"no CIFAR-10 python batches in {str(root)!r}: it needs data_batch_1 ... data_batch_5 and "
                        "test_batch from cifar-10-python.tar.gz, extracted; see datasets/README.md")
    classes = list(CIFAR10_CLASSES)
    if (base / "batches.meta").is_file():
        names = _unpickle(base / "batches.meta").get("label_names")
        if isinstance(names, list) and names:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    def loader(path: Path) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        def load() -> tuple[np.ndarray, np.ndarray]:
            batch = _unpickle(path)
            data, labels = batch.get("data"), batch.get("labels")
            if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
                found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
                raise DataError(f"{str(path)!r} is not a CIFAR-10 batch: 'data' must be uint8 (N, 3072), found {found}")
            y = np.asarray(labels if labels is not None else [], dtype=np.int64)
            if y.shape != (len(data),):
                raise DataError(f"{str(path)!r} holds {len(data)} images but {y.size} labels: download it again")
            if y.size and (y.min() < 0 or y.max() >= len(classes)):
                raise DataError(f"{str(path)!r} has labels outside 0..{len(classes) - 1}: is it a CIFAR-10 batch?")
            return data.reshape(-1, 3, 32, 32), y
        return load

    return _array_parts(spec, [(p, loader(p)) for p in batches], cfg, size, {"classes": classes})


# ---------------------------------------------------------------------------------------------------
# FILE.parquet
# ---------------------------------------------------------------------------------------------------

def _row_stream(pf: Any, columns: list[str], batch_rows: int) -> Callable[[int, int], Any]:
    """take(lo, hi) -> table of rows lo..hi-1, streaming the file's record batches (asked in increasing
    order; a request that goes back starts the stream again)."""
    import pyarrow as pa

    state: dict[str, Any] = {"it": None, "base": 0, "batch": None}

    def take(lo: int, hi: int) -> Any:
        if state["it"] is None or lo < state["base"]:
            state.update(it=pf.iter_batches(batch_size=batch_rows, columns=columns), base=0, batch=None)
        pieces = []
        while lo < hi:
            batch = state["batch"]
            if batch is None or lo >= state["base"] + batch.num_rows:
                if batch is not None:
                    state["base"] += batch.num_rows
                state["batch"] = next(state["it"])
                continue
            end = min(hi, state["base"] + batch.num_rows)
            pieces.append(batch.slice(lo - state["base"], end - lo))
            lo = end
        return pa.Table.from_batches(pieces)

    return take


def _is_image_column(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


def _parquet_labels(col: Any, name: str, where: str) -> tuple[np.ndarray, list[str] | None]:
    import pyarrow as pa

    fix = "pick another column with --label-column"
    if col.null_count:
        raise DataError(f"label column {name!r} of {where!r} has {col.null_count} missing values: fill or drop those rows")
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.cast(t.value_type), t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        classes, y = np.unique(np.asarray(col.to_pylist(), dtype=object), return_inverse=True)
        return y.astype(np.int64).ravel(), [str(c) for c in classes]
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return _labels(col.to_numpy(), f"column {name!r} of {where}"), None
    raise DataError(f"label column {name!r} of {where!r} has type {t}; labels must be integers (class ids) or "
                    f"strings (class names): {fix}")


def _parquet(spec: str, path: Path, cfg: ShardConfig, size: tuple[int, int] | None) -> Source:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {spec!r} needs pyarrow, which is not installed: pip install pyarrow") from None
    if not path.is_file():
        raise DataError(f"SOURCE file {spec!r} not found: check the path")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"cannot read {spec!r} as Parquet ({_reason(exc)})") from None
    names = pf.schema_arrow.names
    label = cfg.label_column or names[-1]
    if label not in names:
        raise DataError(f"--label-column {label!r} is not a column of {spec!r}; its columns are {', '.join(names)}")
    features = [c for c in names if c != label]
    n = pf.metadata.num_rows
    if n == 0 or not features:
        raise DataError(f"{spec!r} holds {n} rows and {len(features)} feature columns: it needs at least one of each "
                        f"besides the label column {label!r}")
    y, classes = _parquet_labels(pf.read(columns=[label]).column(0), label, spec)
    meta: dict[str, Any] = {"label_column": label}
    if classes is not None:
        meta["classes"] = classes
    types = {c: pf.schema_arrow.field(c).type for c in features}
    image_columns = [c for c in features if _is_image_column(types[c])]
    if image_columns:
        if len(image_columns) > 1:
            raise DataError(f"{spec!r} has several image columns ({', '.join(image_columns)}); hpctrain reads one: "
                            "write a file with one image column and the label")
        column = image_columns[0]
        take = _row_stream(pf, [column], 256)
        struct_column = pa.types.is_struct(types[column])

        def get(lo: int, hi: int) -> list[Any]:
            out: list[Any] = []
            for chunk in take(lo, hi).column(0).chunks:
                out += (chunk.field("bytes") if struct_column else chunk).to_pylist()
            return out

        meta["image_column"] = column
        images = _Images(n, y, get, lambda i: f"{path} row {i}")
        return _image_source(spec, images, cfg, size, meta)

    odd = [f"{c} ({types[c]})" for c in features
           if not (pa.types.is_integer(types[c]) or pa.types.is_floating(types[c]) or pa.types.is_boolean(types[c]))]
    if odd:
        raise DataError(f"{spec!r} has columns hpctrain cannot use as features: {', '.join(odd)}; features must be "
                        "numeric (or one column of encoded images): drop those columns, or name the label with --label-column")
    take = _row_stream(pf, features, 65536)

    def read(start: int, stop: int) -> np.ndarray:
        table = take(start, stop)
        x = np.empty((stop - start, len(features)), np.float32)
        for j, name in enumerate(features):
            col = table.column(j)
            if col.null_count:
                raise DataError(f"column {name!r} of {spec!r} has missing values in rows {start}..{stop - 1}: fill or drop them")
            x[:, j] = col.to_numpy()
        return x

    meta["columns"] = features
    return Source(spec, n, (len(features),), np.dtype(np.float32), y, read, meta)
