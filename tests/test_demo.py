"""The README's first command, end to end: `make demo` shards digits and trains on 2 ranks."""

import json
import subprocess

import pytest

from conftest import ROOT, mpi_env


@pytest.mark.slow
def test_make_demo() -> None:
    proc = subprocess.run(["make", "-C", str(ROOT), "demo"], capture_output=True, text=True, timeout=600, env=mpi_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((ROOT / "demo" / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    assert summary["val_accuracy"] >= 0.95
    assert summary["train_time_s"] < 60
    assert "val_accuracy" in proc.stdout
