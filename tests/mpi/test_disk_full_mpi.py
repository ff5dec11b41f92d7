"""Faults a real 2-rank job survives, reported in one line: a damaged meta.json on resume, a run directory on a
full filesystem (a real 3 MiB tmpfs), and mpirun's own boilerplate after a rank has said what went wrong."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from conftest import hpctrain, summary
from hpctrain.checkpoint import manager as ckpt

pytestmark = pytest.mark.mpi

# 2 x 1.2 MB of parameters per checkpoint: the second one cannot fit beside the first in 3 MiB
BIG = ["--model", "mlp:512,512", "--epochs", "20", "--checkpoint-every", "10", "--log-every", "5"]
MPIRUN_BOILERPLATE = ("Primary job", "mpirun detected", "MPI_ABORT", "ORTE_ERROR_LOG", "help message", "-----")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "full"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command: cannot make a small filesystem to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 3 MiB tmpfs (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_flipped_byte_of_meta_json_is_one_warning_line_naming_the_fallback(tmp_path: Path, digits2: Path) -> None:
    run = tmp_path / "run"
    base = ["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), "--checkpoint-every", "10",
            "--keep", "3"]
    hpctrain([*base, "--max-steps", "30"])
    meta = run / "checkpoints" / "step-0000030" / "meta.json"
    data = bytearray(meta.read_bytes())
    data[40] ^= 0x80  # no longer UTF-8
    meta.write_bytes(bytes(data))
    proc = hpctrain([*base, "--max-steps", "40"])
    lines = [line for line in proc.stderr.splitlines() if "damaged" in line]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert len(line) < 300 and "\\x" not in line and "UnicodeDecodeError" not in line, line
    assert "step-0000030" in line and "meta.json is not valid UTF-8 JSON at byte 40" in line
    assert "using step-0000020" in line
    assert summary(run)["resumed_from"] == 20


def test_a_full_disk_ends_the_job_in_one_line_and_the_last_checkpoint_resumes(small_tmpfs: Path, tmp_path: Path,
                                                                              digits2: Path) -> None:
    run = small_tmpfs / "run"
    command = ["launch", "-n", "2", "--", "train", "--data", str(digits2), *BIG]
    proc = hpctrain([*command, "--run-dir", str(run)], check=False, timeout=300)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console
    assert "Logging error" not in console and "Traceback" not in console, console
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    error = errors[0]
    assert "No space left on device" in error and str(run / "checkpoints") in error, error
    assert re.search(r"\d+(\.\d)? (B|KiB|MiB) free", error) and re.search(r"\d+(\.\d)? (B|KiB|MiB) needed", error), error
    last = ckpt.latest(run)  # verified: every checksum
    assert last is not None, error
    assert f"last complete checkpoint: {last}" in error and "free space, then run the same command to continue" in error
    assert not any(text in proc.stderr for text in MPIRUN_BOILERPLATE), proc.stderr
    # the checkpoint the line names loads, and on a filesystem with room the same command finishes from it
    step = ckpt.verify(last)["step"]
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    hpctrain([*command, "--run-dir", str(moved)], timeout=300)
    assert summary(moved)["resumed_from"] == step


def test_launch_leaves_out_mpiruns_boilerplate_only_after_a_rank_said_what_went_wrong(tmp_path: Path) -> None:
    proc = hpctrain(["launch", "-n", "2", "--", "sh", "-c", "echo 'error: rank said why' >&2; exit 1"], check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("error: rank said why") == 2, proc.stderr
    assert not any(text in proc.stderr for text in MPIRUN_BOILERPLATE), proc.stderr
    # no rank said anything: mpirun's own report is all the user gets, and it stays
    proc = hpctrain(["launch", "-n", "2", "--", "sh", "-c", "exit 1"], check=False)
    assert proc.returncode == 1 and "non-zero" in proc.stderr, proc.stderr
    proc = hpctrain(["launch", "-n", "1", "--", str(tmp_path / "no-such-program")], check=False)
    assert proc.returncode != 0 and "no-such-program" in proc.stderr, proc.stderr
