"""`hpctrain shard` on every SOURCE form: placement, sizes, manifest, integrity, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from hpctrain.cli.main import app
from hpctrain.base.config import ShardConfig
from hpctrain.base.durable import sha256_file
from hpctrain.base.errors import ConfigError, DataError
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import NORMALIZE_ON_READ, NORMALIZED_ON_WRITE, load_manifest, manifest_entry, verify
from hpctrain.data.sharding import open_source, shard

runner = CliRunner()


def read_all(out: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    shardset = load_manifest(out)
    result = {}
    for split, files in shardset.splits.items():
        xs, ys, ids = [], [], []
        for f in files:
            with h5py.File(f.path, "r") as h5:
                xs.append(h5["x"][()]); ys.append(h5["y"][()]); ids.append(h5["index"][()])
        result[split] = (np.concatenate(xs), np.concatenate(ys), np.concatenate(ids))
    return result


def check_layout(out: Path, x_src: np.ndarray, y_src: np.ndarray, shards: int) -> None:
    """Every sample of the source in exactly one shard, with its own x and y; sizes differ by at most one."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "hpctrain-shards" and manifest["version"] == 2
    assert manifest["num_shards"] == shards
    assert manifest["x"]["shape"] == list(x_src.shape[1:])
    all_ids = []
    for split, body in manifest["splits"].items():
        counts = [e["samples"] for e in body["shards"]]
        assert max(counts) - min(counts) <= 1, (split, counts)
        assert sum(counts) == body["samples"]
        for e in body["shards"]:
            assert sha256_file(out / e["file"]) == e["sha256"]
            assert e["file"] .startswith(f"{split}/shard-")
    data = read_all(out)
    for split, (x, y, ids) in data.items():
        np.testing.assert_array_equal(y, y_src[ids])
        np.testing.assert_allclose(x, x_src[ids].astype(np.float32))
        all_ids.append(ids)
    ids = np.concatenate(all_ids)
    assert len(ids) == len(x_src) and len(np.unique(ids)) == len(x_src)
    assert verify(out) == []


def test_digits(tmp_path: Path) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    shard(ShardConfig(source="digits", out=tmp_path / "d", shards=3), show_progress=False)
    check_layout(tmp_path / "d", d.data / 16.0, d.target, 3)
    m = load_manifest(tmp_path / "d")
    assert m.num_classes == 10 and m.samples("train") + m.samples("val") == 1797
    assert m.samples("val") == round(1797 * 0.2)


def test_synthetic_is_seeded_and_learnable_shape(tmp_path: Path) -> None:
    src = open_source("synthetic:1000:8:4", seed=5)
    x, y = src.read(0, 1000), src.y
    assert x.shape == (1000, 8) and set(np.unique(y)) <= {0, 1, 2, 3}
    # reads in other chunkings give the same rows
    np.testing.assert_array_equal(open_source("synthetic:1000:8:4", seed=5).read(300, 700), x[300:700])
    shard(ShardConfig(source="synthetic:1000:8:4", out=tmp_path / "s", shards=4, seed=5), show_progress=False)
    check_layout(tmp_path / "s", x, y, 4)


def test_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((101, 3, 4)).astype(np.float64)
    y = rng.integers(0, 5, 101)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    shard(ShardConfig(source=str(tmp_path / "a.npz"), out=tmp_path / "o", shards=2, val_fraction=0.1), show_progress=False)
    check_layout(tmp_path / "o", x, y, 2)
    assert load_manifest(tmp_path / "o").x_dtype == "float64"  # floats are stored as they are


def random_h5(path: Path, seed: int, n: int, d: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = rng.integers(0, classes, n)
    with h5py.File(path, "w") as h5:
        h5["x"] = x
        h5["y"] = y
    return x, y


def test_hdf5_read_in_chunks(tmp_path: Path) -> None:
    x, y = random_h5(tmp_path / "a.h5", 1, 5000, 6, 3)
    import hpctrain.data.sharding as sh

    old = sh._READ_BYTES
    sh._READ_BYTES = 24 * 700  # force many read chunks
    try:
        shard(ShardConfig(source=str(tmp_path / "a.h5"), out=tmp_path / "o", shards=4, chunk_rows=100,
                          hdf5_compression="gzip", workers=1), show_progress=False)  # in this process: sees the patch
    finally:
        sh._READ_BYTES = old
    check_layout(tmp_path / "o", x, y, 4)
    with h5py.File(next((tmp_path / "o" / "train").iterdir()), "r") as h5:
        assert h5["x"].chunks[0] == 100 and h5["x"].compression == "gzip" and h5["x"].fletcher32


def test_hdf5_written_by_worker_processes_is_identical_to_one_process(tmp_path: Path) -> None:
    x, y = random_h5(tmp_path / "a.h5", 2, 3000, 5, 4)
    manifests = {}
    for workers, fsync in ((1, False), (3, True)):
        out = tmp_path / f"w{workers}"
        manifests[workers] = shard(ShardConfig(source=str(tmp_path / "a.h5"), out=out, shards=3, val_fraction=0.2,
                                               workers=workers, fsync=fsync), show_progress=False)
        check_layout(out, x, y, 3)
    digests = {w: [e["sha256"] for split in m["splits"].values() for e in split["shards"]] for w, m in manifests.items()}
    assert digests[1] == digests[3]  # 6 files over 3 workers: the same bytes as one process writes


def test_a_worker_failure_is_one_error_and_leaves_nothing(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "a.h5", "w") as h5:
        h5["x"] = np.zeros((400, 3), np.float32)
        h5["y"] = np.zeros(400, np.int64)
    cfg = ShardConfig(source=str(tmp_path / "a.h5"), out=tmp_path / "o", shards=4, workers=2)
    # the workers open the source anew: make that fail after the parent has opened it
    import hpctrain.data.sharding as sh

    real = sh.open_source

    def open_then_break(*args, **kwargs):
        source = real(*args, **kwargs)
        (tmp_path / "a.h5").rename(tmp_path / "gone.h5")
        return source

    sh.open_source = open_then_break
    try:
        with pytest.raises(DataError, match="not found"):
            shard(cfg, show_progress=False)
    finally:
        sh.open_source = real
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_csv_with_header(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((60, 3)).round(4)
    y = rng.integers(0, 2, 60)
    lines = ["a,b,c,label"] + [",".join(map(str, [*row, lab])) for row, lab in zip(x, y)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    shard(ShardConfig(source=str(tmp_path / "t.csv"), out=tmp_path / "o", shards=2), show_progress=False)
    check_layout(tmp_path / "o", x, y, 2)


def test_refuses_existing_out_and_force_replaces(tmp_path: Path) -> None:
    out = tmp_path / "o"
    shard(ShardConfig(source="synthetic:50", out=out, shards=2), show_progress=False)
    with pytest.raises(ConfigError, match="already exists"):
        shard(ShardConfig(source="synthetic:50", out=out, shards=2), show_progress=False)
    shard(ShardConfig(source="synthetic:60", out=out, shards=3, force=True), show_progress=False)
    assert load_manifest(out).num_shards == 3
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an hpctrain dataset"):
        shard(ShardConfig(source="synthetic:50", out=other, shards=2, force=True), show_progress=False)
    assert (other / "notes.txt").read_text() == "keep me"


def test_verify_names_a_changed_file(tmp_path: Path) -> None:
    out = tmp_path / "o"
    shard(ShardConfig(source="synthetic:200", out=out, shards=2), show_progress=False)
    victim = out / "train" / "shard-00001-of-00002.h5"
    with h5py.File(victim, "r+") as h5:
        h5["y"][0] = (h5["y"][0] + 1) % 10
    problems = verify(out)
    assert len(problems) == 1 and str(victim) in problems[0]
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and str(victim) in result.output


def test_manifest_paths_cannot_escape(tmp_path: Path) -> None:
    out = tmp_path / "o"
    shard(ShardConfig(source="synthetic:40", out=out, shards=2), show_progress=False)
    m = json.loads((out / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["file"] = "../../etc/passwd"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="outside"):
        load_manifest(out)


def _bad_npz(tmp_path: Path, **arrays: np.ndarray) -> str:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "make_source, extra, needle",
    [
        (lambda p: str(p / "missing.npz"), [], "not found"),
        (lambda p: "mnist-ish", [], "unknown SOURCE"),
        (lambda p: "synthetic:abc", [], "synthetic:N"),
        (lambda p: "synthetic:10:0", [], "D >= 1"),
        (lambda p: _bad_npz(p, x=np.zeros((5, 2)), y=np.zeros(4)), [], "same length"),
        (lambda p: _bad_npz(p, x=np.zeros((5, 2))), [], "lacks array"),
        (lambda p: _bad_npz(p, x=np.zeros((5, 2)), y=np.full(5, 0.5)), [], "whole numbers"),
        (lambda p: _bad_npz(p, x=np.zeros((5, 2)), y=np.full(5, -1)), [], "0 or more"),
        (lambda p: (p / "x.npz").write_text("not a zip") and str(p / "x.npz"), [], "cannot read"),
        (lambda p: (p / "x.csv").write_text("1,2,a\n3,4,b\n5,6,c\n") and str(p / "x.csv"), [], "numeric"),
        (lambda p: (p / "x.h5").write_text("nope") and str(p / "x.h5"), [], "HDF5"),
        (lambda p: "synthetic:100", ["--shards", "0"], "--shards"),
        (lambda p: "synthetic:10", ["--shards", "9"], "more than"),
        (lambda p: "synthetic:100", ["--val-fraction", "1.5"], "--val-fraction"),
        (lambda p: "synthetic:100", ["--hdf5-compression", "zstd"], "none, lzf, gzip"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, make_source, extra, needle) -> None:
    source = make_source(tmp_path)
    out = tmp_path / "nested" / "out"
    before = set(tmp_path.rglob("*"))
    result = runner.invoke(app, ["shard", source, str(out), *extra])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output
    assert set(tmp_path.rglob("*")) == before  # no OUT, no temporary directory, no parent created


def test_normalize_minmax_recorded_and_applied(tmp_path: Path) -> None:
    src = open_source("synthetic:500:3:2", seed=0)
    shard(ShardConfig(source="synthetic:500:3:2", out=tmp_path / "o", shards=2, normalize="minmax"), show_progress=False)
    m = load_manifest(tmp_path / "o")
    norm = m.manifest["normalized_on_write"]
    assert norm["method"] == "minmax" and len(norm["offset"]) == 3
    x, _, ids = read_all(tmp_path / "o")["train"]
    assert x.min() >= -1e-6 and x.max() <= 1 + 1e-6
    raw = src.read(0, 500)[ids]
    np.testing.assert_allclose(x, (raw - np.array(norm["offset"], np.float32)) / np.array(norm["scale"], np.float32), rtol=1e-6)


def test_a_normalize_manifest_written_before_the_rename_is_read_the_same(tmp_path: Path) -> None:
    """Older versions wrote --normalize's record as "normalize": the entry is found under its new name, and
    the reader feeds the stored (already normalized) floats as they are."""
    out = tmp_path / "o"
    shard(ShardConfig(source="synthetic:200:3:2", out=out, shards=1, val_fraction=0, normalize="standard"),
          show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    old = {("normalize" if k == "normalized_on_write" else k): v for k, v in manifest.items()} | {"version": 1}
    (out / "manifest.json").write_text(json.dumps(old, indent=2) + "\n")
    shardset = load_manifest(out)
    assert manifest_entry(shardset.manifest, NORMALIZED_ON_WRITE) == manifest["normalized_on_write"]
    assert manifest_entry(shardset.manifest, NORMALIZE_ON_READ) is None
    x, _, ids = read_all(out)["train"]
    reader = ShardReader(shardset, "train", rank=0, world=1, batch_size=64, shuffle=False, prefetch=0)
    batches = list(reader.epoch(0))
    reader.close()
    np.testing.assert_array_equal(np.concatenate([b.x for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.index for b in batches]), ids)
