"""imagefolder:, mnist:, cifar10: and FILE.parquet: stored pixels and labels, normalization, bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from hpctrain.data import imagesets, sharding
from hpctrain.cli.main import app
from hpctrain.base.config import ShardConfig
from hpctrain.base.errors import ConfigError, DataError
from hpctrain.data.images import fit_image, parse_image_size
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import load_manifest, verify
from hpctrain.data.sharding import shard

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "datasets" / "samples"
runner = CliRunner()


def stored(out: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """All samples of a dataset, x and y in source order (by global sample id), and the manifest."""
    shardset = load_manifest(out)
    xs, ys, ids = [], [], []
    for files in shardset.splits.values():
        for f in files:
            with h5py.File(f.path, "r") as h5:
                xs.append(h5["x"][()]); ys.append(h5["y"][()]); ids.append(h5["index"][()])
    order = np.argsort(np.concatenate(ids))
    assert verify(out) == []
    return np.concatenate(xs)[order], np.concatenate(ys)[order], shardset.manifest


def run_shard(source: str, out: Path, **kw) -> tuple[np.ndarray, np.ndarray, dict]:
    shard(ShardConfig(source=source, out=out, shards=kw.pop("shards", 2), workers=kw.pop("workers", 1), **kw),
          show_progress=False)
    return stored(out)


def write_folder(root: Path, images: dict[str, list[np.ndarray]], ext: str = "png") -> Path:
    """root/CLASS/NNN.ext from (H, W) or (H, W, 3) uint8 arrays."""
    for cls, arrays in images.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i, a in enumerate(arrays):
            Image.fromarray(a).save(root / cls / f"{i:03d}.{ext}", quality=95)
    return root


def gray_images(seed: int, count: int, shape: tuple[int, ...] = (5, 6)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def expected_normalization(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = x.astype(np.float64) / 255
    return v.mean(axis=(0, 2, 3)), v.std(axis=(0, 2, 3))


# --- imagefolder -----------------------------------------------------------------------------------

def test_imagefolder_pixels_labels_classes_and_normalization(tmp_path: Path) -> None:
    images = {"cat": gray_images(1, 7), "dog": gray_images(2, 5), "emu": gray_images(3, 6)}
    root = write_folder(tmp_path / "pics", images)
    images["dog"].append(gray_images(4, 1)[0])  # in a nested folder: sorts after dog/00N.png
    (root / "dog" / "more").mkdir()
    Image.fromarray(images["dog"][-1]).save(root / "dog" / "more" / "000.png")
    (root / "cat" / "notes.txt").write_text("not an image, ignored")
    (root / "cat" / "._000.png").write_bytes(b"hidden macOS resource fork, ignored")
    (root / ".cache").mkdir()

    x, y, manifest = run_shard(f"imagefolder:{root}", tmp_path / "out", workers=2)
    want = np.stack([a for cls in sorted(images) for a in images[cls]])[:, None]
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, np.repeat([0, 1, 2], [7, 6, 6]))
    assert x.dtype == np.uint8 and manifest["x"] == {"dtype": "uint8", "shape": [1, 5, 6]}
    assert manifest["classes"] == ["cat", "dog", "emu"] and manifest["num_classes"] == 3
    mean, std = expected_normalization(want)
    norm = manifest["normalize_on_read"]
    assert norm["scale"] == pytest.approx(1 / 255)
    np.testing.assert_allclose(norm["mean"], mean, atol=1e-6)
    np.testing.assert_allclose(norm["std"], std, atol=1e-6)
    assert "skipped" not in manifest
    # the reader turns the stored uint8 into float32 with that normalization
    fed = load_manifest(tmp_path / "out").normalize_on_read(x[:4])
    assert fed.dtype == np.float32
    np.testing.assert_allclose(fed, (x[:4] / 255 - mean[0]) / std[0], atol=1e-4)


def test_a_manifest_written_before_the_rename_is_read_the_same(tmp_path: Path) -> None:
    """Older versions wrote the uint8 images' read-time normalization as "normalization": the reader still
    applies it, and the dataset keeps its fingerprint (the manifest is read as it is, not rewritten)."""
    root = write_folder(tmp_path / "pics", {"a": gray_images(0, 6), "b": gray_images(1, 5)})
    x, _, manifest = run_shard(f"imagefolder:{root}", tmp_path / "out", shards=1)
    want = load_manifest(tmp_path / "out").normalize_on_read(x)
    old = {("normalization" if k == "normalize_on_read" else k): v for k, v in manifest.items()} | {"version": 1}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(old, indent=2) + "\n")
    shardset = load_manifest(tmp_path / "out")
    assert "normalize_on_read" not in shardset.manifest and shardset.manifest == old
    reader = ShardReader(shardset, "train", rank=0, world=1, batch_size=4, shuffle=False, prefetch=0)
    batches = list(reader.epoch(0))
    reader.close()
    fed = np.concatenate([b.x for b in batches])
    assert fed.dtype == np.float32
    np.testing.assert_array_equal(fed, want[np.concatenate([b.index for b in batches])])
    canonical = json.dumps(old, sort_keys=True, separators=(",", ":")).encode()
    assert shardset.fingerprint == hashlib.sha256(canonical).hexdigest()


def test_one_or_two_workers_and_streamed_or_kept_store_the_same(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(5)
    images = {"a": [rng.integers(0, 256, (12 + i % 3, 10 + i % 4, 3), dtype=np.uint8) for i in range(9)],
              "b": [rng.integers(0, 256, (9 + i % 5, 14, 3), dtype=np.uint8) for i in range(8)]}
    root = write_folder(tmp_path / "pics", images, "jpg")
    write_folder(root, {"c": [rng.integers(0, 256, (16, 11), dtype=np.uint8) for _ in range(6)]})
    source = f"imagefolder:{root}"
    kept = run_shard(source, tmp_path / "kept", workers=1, image_size="8x6")
    # Force the streaming path: nothing kept from the checking pass, several reads with a decode ahead.
    monkeypatch.setattr("hpctrain.data.images._KEEP_BYTES", 0)
    monkeypatch.setattr(sharding, "_READ_BYTES", 5 * 3 * 8 * 6)
    for workers in (1, 2):
        x, y, manifest = run_shard(source, tmp_path / f"w{workers}", workers=workers, image_size="8x6", chunk_rows=2)
        np.testing.assert_array_equal(x, kept[0])
        np.testing.assert_array_equal(y, kept[1])
        assert manifest["normalize_on_read"] == kept[2]["normalize_on_read"]
    assert kept[0].shape == (23, 3, 8, 6)  # gray class c made RGB: some images are color
    assert kept[2]["images"]["channels"] == 3


def test_fit_image_scales_to_cover_then_center_crops() -> None:
    a = np.zeros((4, 8), np.uint8)
    a[:, :2], a[:, 2:6], a[:, 6:] = 10, 200, 50
    out = fit_image(Image.fromarray(a), 1, (4, 4))
    np.testing.assert_array_equal(out, np.full((1, 4, 4), 200))
    wide = fit_image(Image.fromarray(np.full((8, 8), 77, np.uint8)), 3, (2, 4))  # HxW = 2x4 from a square
    np.testing.assert_array_equal(wide, np.full((3, 2, 4), 77))
    rgb = np.random.default_rng(0).integers(0, 256, (3, 5, 3), dtype=np.uint8)
    gray = fit_image(Image.fromarray(rgb), 1, None)
    np.testing.assert_array_equal(gray[0], np.asarray(Image.fromarray(rgb).convert("L")))
    assert parse_image_size("224") == (224, 224) and parse_image_size("32x48") == (32, 48)
    for bad in ("0", "x", "12x", "ax3", "-4"):
        with pytest.raises(ConfigError, match="--image-size"):
            parse_image_size(bad)


def test_channels_option(tmp_path: Path) -> None:
    rgb = [np.random.default_rng(i).integers(0, 256, (4, 4, 3), dtype=np.uint8) for i in range(3)]
    root = write_folder(tmp_path / "rgb", {"a": rgb[:2], "b": rgb[2:]})
    x, _, manifest = run_shard(f"imagefolder:{root}", tmp_path / "one", channels=1, shards=1)
    want = np.stack([np.asarray(Image.fromarray(a).convert("L")) for a in rgb])[:, None]
    np.testing.assert_array_equal(x, want)
    assert len(manifest["normalize_on_read"]["mean"]) == 1
    gray = write_folder(tmp_path / "gray", {"a": gray_images(0, 2, (4, 4)), "b": gray_images(1, 1, (4, 4))})
    x3, _, manifest = run_shard(f"imagefolder:{gray}", tmp_path / "three", channels=3, shards=1)
    assert x3.shape == (3, 3, 4, 4) and (x3 == x3[:, :1]).all()
    assert len(manifest["normalize_on_read"]["std"]) == 3


def _truncated_png(path: Path, shape: tuple[int, int] = (40, 40)) -> None:
    buf = path.with_suffix(".tmp.png")
    Image.fromarray(gray_images(9, 1, shape)[0]).save(buf)
    data = buf.read_bytes()
    buf.unlink()
    path.write_bytes(data[: len(data) // 2])  # a valid header, pixel data cut short


def test_skip_bad_counts_and_names_the_files(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "pics", {"a": gray_images(0, 6), "b": gray_images(1, 5)})
    (root / "a" / "zz-garbage.png").write_bytes(b"this is not a png")
    _truncated_png(root / "b" / "zz-truncated.png", (5, 6))
    x, y, manifest = run_shard(f"imagefolder:{root}", tmp_path / "out", skip_bad=True, workers=2)
    assert len(x) == 11 and list(np.bincount(y)) == [6, 5]
    assert manifest["skipped"] == 2
    assert sorted(Path(p).name for p in manifest["skipped_files"]) == ["zz-garbage.png", "zz-truncated.png"]
    # with --image-size and --channels there is no header scan: the decoding pass finds both
    x2, _, manifest = run_shard(f"imagefolder:{root}", tmp_path / "out2", skip_bad=True, image_size="5x6", channels=1)
    np.testing.assert_array_equal(x2, x)
    assert manifest["skipped"] == 2


# --- mnist, cifar10 -------------------------------------------------------------------------------

def idx_bytes(a: np.ndarray) -> bytes:
    return bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write_mnist(root: Path, train: int = 12, test: int = 5, side: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (train + test, side, side), dtype=np.uint8)
    y = rng.integers(0, 10, train + test).astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(x[:train])))
    (root / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(y[:train])))
    (root / "t10k-images.idx3-ubyte").write_bytes(idx_bytes(x[train:]))  # the dotted names some mirrors use
    (root / "t10k-labels.idx1-ubyte").write_bytes(idx_bytes(y[train:]))
    return x, y


def test_mnist_gz_and_plain_idx(tmp_path: Path) -> None:
    x_src, y_src = write_mnist(tmp_path / "mnist")
    x, y, manifest = run_shard(f"mnist:{tmp_path / 'mnist'}", tmp_path / "out")
    np.testing.assert_array_equal(x, x_src[:, None])
    np.testing.assert_array_equal(y, y_src)
    assert [(Path(f["file"]).name, f["first"], f["samples"]) for f in manifest["files"]] == [
        ("train-images-idx3-ubyte.gz", 0, 12), ("t10k-images.idx3-ubyte", 12, 5)]
    mean, std = expected_normalization(x_src[:, None])
    np.testing.assert_allclose(manifest["normalize_on_read"]["mean"], mean, atol=1e-6)
    np.testing.assert_allclose(manifest["normalize_on_read"]["std"], std, atol=1e-6)
    x3, _, _ = run_shard(f"mnist:{tmp_path / 'mnist'}", tmp_path / "rgb", channels=3, image_size="4")
    assert x3.shape == (17, 3, 4, 4)


def write_cifar(root: Path, sizes: tuple[int, ...] = (5, 4), names: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    xs, ys = [], []
    for k, count in enumerate(sizes):
        data = rng.integers(0, 256, (count, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, count)]
        name = "test_batch" if k == len(sizes) - 1 else f"data_batch_{k + 1}"
        (base / name).write_bytes(pickle.dumps({b"data": data, b"labels": labels, b"batch_label": b"x"}, protocol=2))
        xs.append(data); ys.append(labels)
    if names:
        labels = [n.encode() for n in "a b c d e f g h i j".split()]
        (base / "batches.meta").write_bytes(pickle.dumps({b"label_names": labels}, protocol=2))
    return np.concatenate(xs).reshape(-1, 3, 32, 32), np.concatenate(ys)


def test_cifar10_batches(tmp_path: Path) -> None:
    x_src, y_src = write_cifar(tmp_path / "c", (3, 4, 2))
    x, y, manifest = run_shard(f"cifar10:{tmp_path / 'c'}", tmp_path / "out")
    np.testing.assert_array_equal(x, x_src)
    np.testing.assert_array_equal(y, y_src)
    assert manifest["classes"] == list("abcdefghij")
    assert [Path(f["file"]).name for f in manifest["files"]] == ["data_batch_1", "data_batch_2", "test_batch"]
    mean, std = expected_normalization(x_src)
    np.testing.assert_allclose(manifest["normalize_on_read"]["mean"], mean, atol=1e-6)
    np.testing.assert_allclose(manifest["normalize_on_read"]["std"], std, atol=1e-6)
    gray, _, _ = run_shard(f"cifar10:{tmp_path / 'c'}", tmp_path / "gray", channels=1)
    want = np.asarray(Image.fromarray(x_src[0].transpose(1, 2, 0)).convert("L"))
    np.testing.assert_array_equal(gray[0, 0], want)  # the same grayscale as an image file gets


def test_cifar10_refuses_a_pickle_that_runs_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "data_batch_1").write_bytes(pickle.dumps({b"data": Evil()}))
    result = runner.invoke(app, ["shard", f"cifar10:{tmp_path / 'c'}", str(tmp_path / "out")])
    assert result.exit_code == 2 and "refusing to load builtins.print" in result.output
    assert "pwned" not in result.output


# --- parquet ---------------------------------------------------------------------------------------

def test_parquet_numeric_columns_and_class_names(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(6)
    n = 50
    a, b = rng.standard_normal(n).astype(np.float32), rng.integers(-5, 5, n)
    names = rng.choice(["zebra", "ant", "moose"], n)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"a": a, "kind": names, "b": b, "flag": a > 0}), path, row_group_size=7)
    x, y, manifest = run_shard(str(path), tmp_path / "out", label_column="kind", chunk_rows=4)
    np.testing.assert_array_equal(x, np.stack([a, b, a > 0], 1).astype(np.float32))
    assert manifest["classes"] == ["ant", "moose", "zebra"] and manifest["columns"] == ["a", "b", "flag"]
    np.testing.assert_array_equal(y, np.searchsorted(["ant", "moose", "zebra"], names))
    src = imagesets.open_dataset_source(str(path), ShardConfig(source=str(path), out=tmp_path, label_column="kind"))
    np.testing.assert_array_equal(src.read(30, 44), x[30:44])
    np.testing.assert_array_equal(src.read(3, 9), x[3:9])  # going back restarts the stream


def test_parquet_image_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import io

    arrays = gray_images(8, 9, (6, 6))
    blobs = []
    for a in arrays:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        blobs.append({"bytes": buf.getvalue(), "path": None})
    labels = [i % 3 for i in range(9)]
    path = tmp_path / "img.parquet"
    pq.write_table(pa.table({"label": labels, "image": blobs, "id": list(range(9))}), path, row_group_size=4)
    x, y, manifest = run_shard(str(path), tmp_path / "out", label_column="label", workers=2)
    np.testing.assert_array_equal(x, np.stack(arrays)[:, None])
    np.testing.assert_array_equal(y, labels)
    assert manifest["image_column"] == "image"


def test_parquet_without_pyarrow_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        imagesets.open_dataset_source("x.parquet", ShardConfig(source="x.parquet", out=tmp_path))


# --- bad input: exit 2, one line naming the path, nothing written -------------------------------------

def _corrupt(p: Path) -> str:
    root = write_folder(p / "pics", {"a": gray_images(0, 2), "b": gray_images(1, 2)})
    (root / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    return f"imagefolder:{root}"


def _truncated(p: Path) -> str:
    root = write_folder(p / "pics", {"a": gray_images(0, 2, (40, 40)), "b": gray_images(1, 2, (40, 40))})
    _truncated_png(root / "a" / "cut.png")
    return f"imagefolder:{root}"


def _mismatched(p: Path) -> str:
    root = write_folder(p / "pics", {"a": gray_images(0, 2, (5, 6)), "b": gray_images(1, 1, (7, 6))})
    return f"imagefolder:{root}"


def _truncated_idx(p: Path) -> str:
    write_mnist(p / "m")
    data = (p / "m" / "t10k-images.idx3-ubyte").read_bytes()
    (p / "m" / "t10k-images.idx3-ubyte").write_bytes(data[:-10])
    return f"mnist:{p / 'm'}"


def _truncated_gz(p: Path) -> str:
    write_mnist(p / "m")
    data = (p / "m" / "train-images-idx3-ubyte.gz").read_bytes()
    (p / "m" / "train-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    return f"mnist:{p / 'm'}"


def _mkdirs(p: Path, *names: str) -> Path:
    for name in names:
        (p / name).mkdir(parents=True)
    return p / names[0]


def _flat_folder(p: Path) -> str:
    (p / "flat").mkdir()
    Image.fromarray(gray_images(0, 1)[0]).save(p / "flat" / "one.png")
    return f"imagefolder:{p / 'flat'}"


def _cut_batch(p: Path) -> str:
    write_cifar(p / "c")
    batch = p / "c" / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(batch.read_bytes()[:500])
    return f"cifar10:{p / 'c'}"


@pytest.mark.parametrize(
    "make_source, extra, needle",
    [
        (lambda p: f"imagefolder:{_mkdirs(p, 'empty')}", [], "empty'"),
        (_flat_folder, [], "flat"),
        (lambda p: f"imagefolder:{_mkdirs(p, 'e/a', 'e/b').parent}", [], "e/a"),
        (_corrupt, [], "broken.png"),
        (_truncated, [], "cut.png"),
        (_mismatched, [], "b/000.png"),
        (lambda p: f"imagefolder:{p / 'missing'}", [], "missing"),
        (_truncated_idx, [], "t10k-images.idx3-ubyte"),
        (_truncated_gz, [], "train-images-idx3-ubyte.gz"),
        (lambda p: f"mnist:{_mkdirs(p, 'nothing')}", [], "nothing"),
        (_cut_batch, [], "data_batch_1"),
        (lambda p: f"cifar10:{_mkdirs(p, 'nocifar')}", [], "nocifar"),
        (lambda p: (p / "t.parquet").write_text("not parquet") and str(p / "t.parquet"), [], "t.parquet"),
        (_mismatched, ["--image-size", "3x"], "--image-size"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, make_source, extra, needle) -> None:
    source = make_source(tmp_path)
    out = tmp_path / "nested" / "out"
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, ["shard", source, str(out), "--workers", "1", *extra])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert set(tmp_path.rglob("*")) == before  # no OUT, no temporary directory, no parent created


def test_mismatched_sizes_message_names_the_fix(tmp_path: Path) -> None:
    result = runner.invoke(app, ["shard", _mismatched(tmp_path), str(tmp_path / "out"), "--workers", "1"])
    assert result.exit_code == 2 and "differ in size" in result.output and "--image-size" in result.output
    assert "is 5x6 (HxW) but" in result.output and "is 7x6" in result.output


def test_corrupt_image_in_two_workers_names_it(tmp_path: Path) -> None:
    source = _corrupt(tmp_path)
    result = runner.invoke(app, ["shard", source, str(tmp_path / "out"), "--workers", "2"])
    assert result.exit_code == 2 and "broken.png" in result.output and "--skip-bad" in result.output
    assert not (tmp_path / "out").exists()


# --- the checked-in samples -------------------------------------------------------------------------

@pytest.mark.parametrize("source, extra, shape", [
    ("imagefolder:{samples}/images", ["--image-size", "16"], [3, 16, 16]),
    ("mnist:{samples}/mnist", [], [1, 28, 28]),
    ("cifar10:{samples}/cifar10", [], [3, 32, 32]),
    ("{samples}/table.parquet", [], [16]),
    ("{samples}/images.parquet", ["--channels", "1"], [1, 16, 16]),
])
def test_samples_shard(tmp_path: Path, source: str, extra: list[str], shape: list[int]) -> None:
    """The commands of datasets/README.md work on the checked-in samples."""
    if source.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    out = tmp_path / "out"
    result = runner.invoke(app, ["shard", source.format(samples=SAMPLES), str(out), "--shards", "1", *extra])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["x"]["shape"] == shape


def test_make_samples_reproduces_the_array_files(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "datasets" / "make_samples.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for rel in ("mnist/train-images-idx3-ubyte.gz", "mnist/t10k-labels-idx1-ubyte", "cifar10/data_batch_1",
                "cifar10/batches.meta"):
        assert (tmp_path / rel).read_bytes() == (SAMPLES / rel).read_bytes(), f"regenerate: python datasets/make_samples.py ({rel})"
    assert sorted(p.name for p in (tmp_path / "images").rglob("*.*")) == sorted(p.name for p in (SAMPLES / "images").rglob("*.*"))


def test_normalize_flag_stores_float32_without_the_uint8_normalization(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "pics", {"a": gray_images(0, 6), "b": gray_images(1, 5)})
    x, _, manifest = run_shard(f"imagefolder:{root}", tmp_path / "out", normalize="standard")
    assert x.dtype == np.float32 and "normalize_on_read" not in manifest and manifest["classes"] == ["a", "b"]
