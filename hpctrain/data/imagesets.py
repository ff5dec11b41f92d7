"""Dataset files as users have them on disk, opened as a `Source` for `hpctrain shard`.

The SOURCE forms: `imagefolder:DIR` (one subfolder per class; the class is the subfolder's name, in sorted
order), `mnist:DIR` (the idx files, gzipped or not), `cifar10:DIR` (the python batches) and `FILE.parquet`
(numeric columns, or one column of encoded images, plus a label column). Images are stored as uint8
(N, C, H, W); image files and a Parquet image column are decoded by `images`, image arrays (MNIST, CIFAR-10)
are converted here, with the same --channels and --image-size.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..base.config import ShardConfig
from ..base.errors import DataError
from .images import Images, error_text, fit_image, image_source, parse_image_size, pixel_normalization
from .sources import Source, check_labels

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".pbm", ".tif", ".tiff", ".webp")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_ARRAY_ROWS = 4096  # rows of an in-memory array converted at a time


def open_dataset_source(spec: str, cfg: ShardConfig) -> Source:
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
    images = Images(len(paths), labels, lambda lo, hi: paths[lo:hi], lambda i: paths[i])
    return image_source(spec, images, cfg, size, {"classes": classes})


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
        ys.append(check_labels(y, str(path)))
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
            **pixel_normalization(hist, offset, cfg)}
    return Source(spec, offset, tuple(shape), np.dtype(np.uint8), np.concatenate(ys), read, meta, cache.clear)


def _idx(path: Path, ndim: int) -> np.ndarray:
    """An idx file (MNIST's format; gzipped or not) as a uint8 array, refusing one that is cut short."""
    again = "download it again (and gunzip only whole files)"
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {str(path)!r} ({error_text(exc)}): the file is incomplete or corrupt; {again}") from None
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
        raise DataError(f"cannot read {str(path)!r} as a CIFAR-10 python batch ({error_text(exc)}): "
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
        return check_labels(col.to_numpy(), f"column {name!r} of {where}"), None
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
        raise DataError(f"cannot read {spec!r} as Parquet ({error_text(exc)})") from None
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
        images = Images(n, y, get, lambda i: f"{path} row {i}")
        return image_source(spec, images, cfg, size, meta)

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
