"""Exact resume on every entry path (issue #54 items 1 and 9): the library's loops (examples/custom_loop.py
and the loop of docs/guides/library-api.md) resumed from a periodic checkpoint end bit-identical to the
uninterrupted run, and a resume on another world size keeps the epoch; `hpctrain train` continued on another
world size counts the run's epochs, says what changed on its first line, and refuses a changed model in one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, hpctrain, mpirun, summary

pytestmark = pytest.mark.mpi
LOOP = ROOT / "examples" / "custom_loop.py"
GUIDE = Path(__file__).parent / "scripts" / "resume_guide_loop.py"


def _last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _drop_newest_checkpoint(run: Path) -> None:
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    shutil.rmtree(newest)


def test_custom_loop_resumed_from_a_periodic_checkpoint_ends_bit_identical(digits2: Path, tmp_path: Path) -> None:
    """Before: the resume from step 50 replayed the batch of step 50 and ended at step 70 with another hash."""
    run = tmp_path / "loop"
    args = [str(LOOP), "--data", str(digits2), "--run-dir", str(run), "--epochs", "3"]
    straight = _last_json(mpirun(2, args, python_module=False))
    assert straight["step"] == 3 * 23, straight
    _drop_newest_checkpoint(run)  # the run's end: the newest left is the periodic one of step 50
    proc = mpirun(2, args, python_module=False)
    assert "resumed from step 50 (" in proc.stderr, proc.stderr
    resumed = _last_json(proc)
    assert (resumed["step"], resumed["param_sha256"]) == (straight["step"], straight["param_sha256"])


def test_the_library_guide_loop_resumed_mid_epoch_ends_bit_identical(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "guide"
    args = [str(GUIDE), str(digits2), str(run), "3", "30", "0"]  # 3 epochs, a checkpoint every 30 steps
    straight = _last_json(mpirun(2, args, python_module=False))
    _drop_newest_checkpoint(run)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert int(newest.name[5:]) % 30 == 0 and int(newest.name[5:]) % 23, newest  # a periodic one, mid-epoch
    resumed = _last_json(mpirun(2, args, python_module=False))
    assert (resumed["step"], resumed["epoch"], resumed["param_sha256"]) == (
        straight["step"], straight["epoch"], straight["param_sha256"])
    assert resumed["samples"] < straight["samples"]


def test_the_library_loop_resumed_on_another_world_size_keeps_the_epoch(digits2: Path, tmp_path: Path) -> None:
    """Before: on another world size the loader started again at epoch 0, so `while loader.epoch < N` trained N
    more epochs."""
    run = tmp_path / "elastic"
    args = [str(GUIDE), str(digits2), str(run), "2", "1000"]  # 2 epochs, no periodic checkpoint
    cut = _last_json(mpirun(2, [*args, "30"], python_module=False))  # cut short after step 30
    assert (cut["step"], cut["epoch"]) == (30, 1), cut  # mid-way through the second epoch
    proc = mpirun(1, [*args, "0"], python_module=False)
    first = proc.stderr.splitlines()[0]
    assert first.startswith("resumed from step 30 (") and first.endswith(
        "; changed since: world size 2 -> 1, global batch 64 -> 32"), proc.stderr
    rest = _last_json(proc)
    n_train = json.loads((digits2 / "manifest.json").read_text())["splits"]["train"]["samples"]
    assert rest["epoch"] == 2, rest
    assert cut["samples"] + rest["samples"] == 2 * n_train, (cut, rest, n_train)


def test_train_continued_on_another_world_size_counts_the_run_s_epochs_and_says_what_changed(
        digits2: Path, tmp_path: Path) -> None:
    """Before: summary.json counted the steps at the last world size's rate (3 epochs for 1 on one rank, then 1
    on two: 68 steps of 23), and the first line said nothing of the world size or the global batch."""
    run = tmp_path / "run"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "1"])
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "2", "--lr", "0.02"])
    first = proc.stderr.splitlines()[0]
    assert first.startswith("resumed from step 45 "), proc.stderr
    assert "world size 1 -> 2" in first and "global batch 32 -> 64" in first and "lr: 0.05 -> 0.02" in first, first
    assert (summary(run)["steps"], summary(run)["epochs"]) == (45 + 23, 2), summary(run)


@pytest.mark.quick
def test_train_resumed_mid_epoch_with_another_batch_size_trains_every_sample_of_the_epoch_once(
        digits2: Path, tmp_path: Path) -> None:
    """Before: the rest of the epoch was counted at the new batch size: 5 steps of 32 per rank resumed at 16
    skipped 80 samples per rank instead of 160, and trained 160 of the epoch twice."""
    run = tmp_path / "run"
    args = ["train", "--data", str(digits2), "--run-dir", str(run), "--audit-samples"]
    mpirun(2, [*args, "--max-steps", "5"])
    proc = mpirun(2, [*args, "--epochs", "1", "--batch-size", "16"])
    assert "batch_size: 32 -> 16" in proc.stderr.splitlines()[0], proc.stderr
    ids = [line.split()[1] for f in sorted((run / "samples").glob("rank-*.txt"))
           for line in f.read_text().splitlines() if line.split()[0] == "0"]
    n_train = json.loads((digits2 / "manifest.json").read_text())["splits"]["train"]["samples"]
    assert len(ids) == n_train and len(set(ids)) == n_train, (len(ids), len(set(ids)))


@pytest.mark.parametrize("split", [(), ("--pp", "2")], ids=["plain", "pipeline"])
def test_train_resumed_with_another_model_is_refused_in_one_line(digits2: Path, tmp_path: Path, split: tuple) -> None:
    """Before: a warning, then a raw `RuntimeError: Error(s) in loading state_dict` on every rank, exit 1."""
    run = tmp_path / "run"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "2"])
    proc = hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), "--max-steps",
                     "4", "--model", "mlp:32", *split], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "RuntimeError" not in proc.stderr, proc.stderr
    assert "mlp:32" in lines[0] and "--run-dir" in lines[0] and "'mlp'" in lines[0], lines[0]
