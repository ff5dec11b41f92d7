"""Buffers on several ranks (BatchNorm's running statistics, a module's own counter): rank 0's are broadcast at
every step, as DDP's broadcast_buffers=True does, so a model with BatchNorm trains on 2 ranks and ends with equal
parameters and buffers, a checkpoint holds what the ranks hold, and a run stopped and resumed ends bit for bit where
the uninterrupted one does: `hpctrain train` at ZeRO 0-3 with overlap off and on, and the library API in every
such cell (one MPI launch). A checkpoint of format 2, written when each rank kept its own buffers, still resumes
and says in one line that its buffers mix ranks' values."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import hpctrain, mpirun, summary
from hpctrain.checkpoint import manager as ckpt

pytestmark = pytest.mark.mpi
SCRIPTS = Path(__file__).parent / "scripts"
MODEL = f"{SCRIPTS / 'buffers_model.py'}:build"  # Linear, BatchNorm1d, ReLU, a forward counter, Linear
BASE = ["--model", MODEL, "--no-shuffle", "--batch-size", "16", "--seed", "1", "--bucket-mb", "0.002",
        "--checkpoint-every", "3", "--max-steps", "6", "--json"]


def train(n: int, data: Path, run: Path, *args: str) -> subprocess.CompletedProcess:
    return hpctrain(["launch", "-n", str(n), "--", "train", "--data", str(data), "--run-dir", str(run), *BASE, *args],
                    check=False, timeout=240)


def test_a_batchnorm_model_trains_on_two_ranks_and_the_checkpoint_holds_what_the_ranks_hold(
        tmp_path: Path, digits2: Path) -> None:
    run = tmp_path / "run"
    proc = train(2, digits2, run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary(run)
    assert s["ranks_in_sync"] and s["steps"] == 6
    whole = torch.load(run / "model.pt", weights_only=True)  # rank 0's state, which every rank ended with
    assert int(whole["4.seen"]) == 6 and int(whole["2.num_batches_tracked"]) == 6
    saved = ckpt.load_files(run / "checkpoints" / "step-0000006")["model"]
    assert saved.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(saved[key], value), key


@pytest.mark.parametrize("zero,overlap", [(0, "--no-overlap"), (0, "--overlap"), (1, "--overlap"),
                                          (2, "--no-overlap"), (3, "--no-overlap"), (3, "--overlap")])
def test_a_batchnorm_run_resumed_at_step_3_ends_bit_for_bit_where_the_uninterrupted_one_does(
        tmp_path: Path, digits2: Path, zero: int, overlap: str) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    args = ["--zero", str(zero), overlap]
    proc = train(2, digits2, whole, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copytree(whole / "checkpoints" / "step-0000003", resumed / "checkpoints" / "step-0000003")
    proc = train(2, digits2, resumed, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = summary(whole), summary(resumed)
    assert second["resumed_from"] == 3 and second["ranks_in_sync"] and first["ranks_in_sync"]
    assert second["param_sha256"] == first["param_sha256"]
    assert "mix ranks' values" not in proc.stderr  # format 3: its buffers are rank 0's


def test_a_checkpoint_of_format_2_whose_buffers_mix_ranks_resumes_and_says_so_in_one_line(tmp_path: Path,
                                                                                          digits2: Path) -> None:
    """tests/golden/ckpt-format2-buffers: step 4 of this model on 2 ranks, written by the version before format 3
    (its own run ended with "ranks ended with different parameters"); rank 1 wrote the running mean and the
    counter, rank 0 the running variance. The digits shards are the same; the manifest is that run's. Paths are
    relative, as that run gave them."""
    golden = Path(__file__).parents[1] / "golden"
    shutil.copytree(digits2, tmp_path / "data")
    shutil.copy(golden / "ckpt-format2-buffers-manifest.json", tmp_path / "data" / "manifest.json")
    shutil.copytree(golden / "ckpt-format2-buffers", tmp_path / "run" / "checkpoints" / "step-0000004")
    shutil.copy(SCRIPTS / "buffers_model.py", tmp_path)
    proc = hpctrain(["launch", "-n", "2", "--", "train", "--data", "data", "--run-dir", "run", "--model",
                     "buffers_model.py:build", "--no-shuffle", "--batch-size", "16", "--seed", "1", "--max-steps", "8",
                     "--checkpoint-every", "0", "--json"], check=False, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [line for line in proc.stderr.splitlines() if "mix ranks' values" in line]
    assert len(warned) == 1 and "(format 2, 2 ranks) holds buffers that ranks other than rank 0 wrote " \
        "(2.running_mean, 4.seen)" in warned[0], proc.stderr
    s = summary(tmp_path / "run")
    assert s["resumed_from"] == 4 and s["steps"] == 8 and s["ranks_in_sync"]
    whole = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert int(whole["4.seen"]) == 8 and int(whole["2.num_batches_tracked"]) == 8
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-0000008" / "meta.json").read_text())["format"] == 3


def test_the_library_api_keeps_buffers_equal_and_resumes_them_exactly_at_every_stage_with_and_without_overlap(
        tmp_path: Path) -> None:
    proc = mpirun(2, [str(SCRIPTS / "buffers_api_check.py"), str(tmp_path / "runs")], python_module=False,
                  timeout=300)
    assert "BUFFERS API OK 2 8" in proc.stdout


def test_horovods_sync_batch_norm_gives_the_global_batch_statistics_in_a_library_loop(tmp_path: Path) -> None:
    """The docs' answer for statistics over all ranks (torch.nn.SyncBatchNorm needs a torch process group)."""
    proc = mpirun(2, [str(SCRIPTS / "buffers_syncbn_check.py")], python_module=False, timeout=240)
    assert "SYNCBN OK 2 4" in proc.stdout
