"""`hpctrain launch` refuses a rank count it cannot run before anything else reads it (#54 item 10)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpctrain.cli.main import app


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("c") / "d"
    assert CliRunner().invoke(app, ["shard", "synthetic:64:5:3", str(out), "--shards", "2"]).exit_code == 0
    return out


@pytest.mark.parametrize("n", ["0", "-2"])
def test_launch_train_refuses_no_ranks_in_one_line(data: Path, tmp_path: Path, n: str) -> None:
    """Before: the shard check divided by the rank count first, and `-n 0` printed a ZeroDivisionError
    traceback; the count is now checked before the train arguments are."""
    argv = ["launch", "-n", n, "--", "train", "--data", str(data), "--run-dir", str(tmp_path / "r")]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: -n {n} must be at least 1 rank"], proc.stderr
    assert not (tmp_path / "r").exists()
