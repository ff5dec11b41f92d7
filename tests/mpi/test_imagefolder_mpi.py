"""A real image dataset end to end: scikit-learn's digits as PNG files -> `shard imagefolder:` -> `cnn` on 2 ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, hpctrain, mpirun, summary

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_digits_png_folder_trains_a_cnn_on_two_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "digits-png"
    subprocess.run([PYTHON, str(ROOT / "datasets" / "digits_to_imagefolder.py"), str(folder)], check=True,
                   capture_output=True, timeout=120)
    assert len(list(folder.glob("*/*.png"))) == 1797

    data = tmp_path / "data"
    hpctrain(["shard", f"imagefolder:{folder}", str(data), "--shards", "2", "--workers", "2"])
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["x"] == {"dtype": "uint8", "shape": [1, 8, 8]}
    assert manifest["classes"] == [str(d) for d in range(10)] and manifest["num_samples"] == 1797
    assert set(manifest["normalize_on_read"]) >= {"scale", "mean", "std"}

    run = tmp_path / "run"
    mpirun(2, ["train", "--data", str(data), "--run-dir", str(run), "--model", "cnn", "--optimizer", "adam",
               "--lr", "0.003", "--epochs", "6", "--batch-size", "16", "--checkpoint-every", "0"])
    s = summary(run)
    assert s["world_size"] == 2 and s["ranks_in_sync"]
    assert s["val_accuracy"] >= 0.95, s
