"""`mpirun -n K hpctrain shard`: ranks write their own files in parallel, one manifest; same data as alone."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import hpctrain, mpirun
from hpctrain.data.shardformat import load_manifest, verify

pytestmark = pytest.mark.mpi


def contents(out: Path) -> dict[str, tuple]:
    result = {}
    for split, files in load_manifest(out).splits.items():
        for f in files:
            with h5py.File(f.path, "r") as h5:
                result[f"{split}/{f.path.name}"] = (h5["x"][()], h5["y"][()], h5["index"][()])
    return result


@pytest.mark.parametrize("n", [2, 3])
def test_parallel_shard_equals_serial(tmp_path: Path, n: int) -> None:
    args = ["synthetic:3001:6:4", "--shards", "4", "--normalize", "standard", "--hdf5-compression", "lzf", "--chunk-rows", "100"]
    hpctrain(["shard", args[0], str(tmp_path / "serial"), *args[1:]])
    proc = mpirun(n, ["shard", args[0], str(tmp_path / "par"), *args[1:]])
    assert proc.stdout.count("wrote 4 shards") == 1  # rank 0 reports once
    a, b = contents(tmp_path / "serial"), contents(tmp_path / "par")
    assert sorted(a) == sorted(b)
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_array_equal(x, y)
    assert verify(tmp_path / "par") == []
    assert {p.name for p in tmp_path.iterdir()} == {"serial", "par"}  # no temporary directory left
    m = json.loads((tmp_path / "par" / "manifest.json").read_text())
    assert m["normalized_on_write"]["method"] == "standard"
    train = np.concatenate([v[0] for k, v in b.items() if k.startswith("train/")])
    np.testing.assert_allclose(train.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=0), 1, atol=1e-4)


def test_parallel_shard_bad_input_leaves_nothing(tmp_path: Path) -> None:
    proc = mpirun(2, ["shard", str(tmp_path / "missing.npz"), str(tmp_path / "out")], check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("not found") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n", [1, 2])
def test_bench_data_reads_every_sample_and_times_each_epochs_first_batch(tmp_path: Path, n: int) -> None:
    data = tmp_path / "d"
    hpctrain(["shard", "synthetic:1200:16:3", str(data), "--shards", "2", "--val-fraction", "0"])
    got = json.loads(hpctrain(["bench", "data", str(data), "-n", str(n), "--epochs", "3", "--batch-size", "64",
                               "--json"]).stdout.strip().splitlines()[-1])
    assert got["world_size"] == n and got["samples"] == 1200 and got["sample_bytes"] == 16 * 4
    assert len(got["first_batch_ms"]) == 3 and all(0 < v < 10_000 for v in got["first_batch_ms"])
    assert got["reader_samples_per_s"] > 0 and got["raw_samples_per_s"] > 0
    assert got["held"] is True  # 600 rows of 64 bytes a rank: one window, read once and held
