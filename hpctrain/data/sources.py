"""The SOURCE a shard set is written from: the `Source` type every form is opened as, the label checks
they share, and the simple forms (digits, synthetic:N[:D[:C]], FILE.npz, FILE.h5/FILE.hdf5, FILE.csv).

The image and dataset-file forms (imagefolder:, mnist:, cifar10:, FILE.parquet) are in `imagesets`; the
writer's `sharding.open_source` picks between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..base.errors import DataError
from .hdf5env import reader_locking

SOURCE_FORMS = ("digits, synthetic:N[:D[:C]], FILE.npz, FILE.h5/FILE.hdf5, FILE.csv, imagefolder:DIR, mnist:DIR, "
                "cifar10:DIR or FILE.parquet")


@dataclass(slots=True)
class Source:
    """A dataset to shard: sample shape and dtype, all labels, and chunked access to x.

    `read(start, stop)` returns rows start:stop of x; the array may be a buffer that the next call reuses
    (a fresh 64 MiB array per read pays its page faults every time), so use it before reading again.
    """

    name: str
    n: int
    x_shape: tuple[int, ...]
    x_dtype: np.dtype
    y: np.ndarray
    read: Callable[[int, int], np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    reopenable: bool = False
    """Cheap to open again in another process (a file read in pieces): worker processes may write shards."""

    @property
    def num_classes(self) -> int:
        """Classes the model must output: the named classes when the source names them, else max label + 1."""
        named = len(self.meta.get("classes", []))
        return max(named, int(self.y.max()) + 1 if self.n else 0)


def check_labels(y: np.ndarray, where: str) -> np.ndarray:
    """`y` as int64 class ids, one per sample; raise DataError naming `where` when they are not whole
    numbers of at least 0 (or there are none)."""
    y = np.asarray(y)
    if y.ndim != 1:
        y = y.reshape(len(y), -1)
        if y.shape[1] != 1:
            raise DataError(f"labels in {where} must be one integer per sample, found shape {y.shape}")
        y = y[:, 0]
    if y.size == 0:
        raise DataError(f"{where} holds no samples")
    if not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.number) or not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
            raise DataError(f"labels in {where} must be whole numbers (class ids 0..C-1), found {y.dtype} values such as {y[:3].tolist()}")
    y = y.astype(np.int64)
    if y.min() < 0:
        raise DataError(f"labels in {where} must be 0 or more, found {int(y.min())}")
    return y


def _check_lengths(n_x: int, n_y: int, where: str) -> None:
    if n_x != n_y:
        raise DataError(f"{where}: x has {n_x} samples but y has {n_y}; they must have the same length")


def _digits() -> Source:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    return Source("digits", len(x), (64,), x.dtype, d.target.astype(np.int64), lambda s, e: x[s:e],
                  meta={"preprocessing": "x = pixel / 16 (scikit-learn digits, 8x8 pixels 0..16, scaled to [0, 1])"})


def _synthetic(spec: str, seed: int) -> Source:
    parts = spec.split(":")[1:]
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError
        n, d, c = (int(p) for p in parts + ["32", "10"][len(parts) - 1:])
    except ValueError:
        raise DataError(f"bad SOURCE {spec!r}: write synthetic:N[:D[:C]] with whole numbers, e.g. synthetic:10000:32:10") from None
    if n < 1 or d < 1 or c < 2:
        raise DataError(f"bad SOURCE {spec!r}: need N >= 1 samples, D >= 1 features and C >= 2 classes")
    weights = np.random.default_rng([seed, 7]).standard_normal((d, c)).astype(np.float32)
    block = 4096

    def read(start: int, stop: int) -> np.ndarray:
        # Generated in fixed blocks so a row's value does not depend on how the caller chunks the reads.
        out = []
        for b in range(start // block, (stop - 1) // block + 1):
            x = np.random.default_rng([seed, 11, b]).standard_normal((min(block, n - b * block), d), dtype=np.float32)
            lo, hi = max(start, b * block) - b * block, min(stop, (b + 1) * block) - b * block
            out.append(x[lo:hi])
        return np.concatenate(out)

    y = np.empty(n, np.int64)
    for s in range(0, n, block * 16):
        e = min(n, s + block * 16)
        y[s:e] = np.argmax(read(s, e) @ weights, axis=1)
    return Source(spec, n, (d,), np.dtype(np.float32), y, read,
                  meta={"preprocessing": f"x ~ N(0, 1) per feature; y = argmax(x @ W), W seeded by --seed ({seed})"})


def _npz(path: Path) -> Source:
    try:
        arrays = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {str(path)!r} as an .npz archive ({exc})") from exc
    with arrays:
        missing = [k for k in ("x", "y") if k not in arrays.files]
        if missing:
            raise DataError(f"{str(path)!r} lacks array(s) {', '.join(missing)}: it needs 'x' (samples) and 'y' (labels); found {arrays.files}")
        x, y = arrays["x"], arrays["y"]
    if x.ndim < 1:
        raise DataError(f"'x' in {str(path)!r} must have one row per sample, found a scalar")
    _check_lengths(len(x), len(y), str(path))
    y = check_labels(y, str(path))
    return Source(str(path), len(x), tuple(x.shape[1:]), x.dtype, y, lambda s, e: x[s:e])


def _hdf5(path: Path) -> Source:
    import h5py

    try:
        h5 = h5py.File(path, "r", locking=reader_locking())
    except OSError as exc:
        raise DataError(f"cannot open {str(path)!r} as HDF5 ({exc})") from exc
    missing = [k for k in ("x", "y") if k not in h5 or not isinstance(h5[k], h5py.Dataset)]
    if missing:
        h5.close()
        raise DataError(f"{str(path)!r} lacks dataset(s) {', '.join(missing)}: it needs 'x' (samples) and 'y' (labels)")
    x = h5["x"]
    if x.ndim < 1:
        h5.close()
        raise DataError(f"'x' in {str(path)!r} must have one row per sample")
    try:
        _check_lengths(x.shape[0], h5["y"].shape[0], str(path))
        y = check_labels(h5["y"][()], str(path))
    except DataError:
        h5.close()
        raise
    buffer: list[np.ndarray] = []

    def read(start: int, stop: int) -> np.ndarray:
        # into one buffer reused from read to read (see Source)
        if not buffer or len(buffer[0]) < stop - start:
            buffer[:] = [np.empty((stop - start, *x.shape[1:]), x.dtype)]
        out = buffer[0][:stop - start]
        if stop > start:
            x.read_direct(out, np.s_[start:stop])
        return out

    return Source(str(path), x.shape[0], tuple(x.shape[1:]), x.dtype, y, read, close=h5.close, reopenable=True)


def _csv(path: Path) -> Source:
    try:
        with open(path) as fh:
            first = fh.readline()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {str(path)!r} as text ({exc})") from exc
    if not first.strip():
        raise DataError(f"{str(path)!r} is empty: a CSV needs numeric columns with the integer label last")
    try:
        [float(v) for v in first.split(",")]
        skip = 0
    except ValueError:
        skip = 1  # a header line
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2, dtype=np.float64)
    except ValueError as exc:
        raise DataError(f"{str(path)!r} is not a numeric CSV ({exc}); every column must be a number, the last one the label") from exc
    if table.shape[1] < 2:
        raise DataError(f"{str(path)!r} has {table.shape[1]} column(s); it needs at least one feature and the label")
    x = table[:, :-1].astype(np.float32)
    y = check_labels(table[:, -1], str(path))
    return Source(str(path), len(x), (x.shape[1],), x.dtype, y, lambda s, e: x[s:e])


def open_simple_source(spec: str, seed: int = 0) -> Source:
    """Open one of the simple forms; raise DataError naming the value when it cannot be used (an unknown
    form lists all of SOURCE_FORMS)."""
    if spec == "digits":
        return _digits()
    if spec.startswith("synthetic"):
        return _synthetic(spec, seed)
    path = Path(spec)
    suffix = path.suffix.lower()
    readers = {".npz": _npz, ".h5": _hdf5, ".hdf5": _hdf5, ".csv": _csv}
    if suffix not in readers:
        raise DataError(f"unknown SOURCE {spec!r}: use one of {SOURCE_FORMS}")
    if not path.is_file():
        raise DataError(f"SOURCE file {spec!r} not found: check the path")
    return readers[suffix](path)
