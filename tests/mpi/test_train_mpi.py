"""`hpctrain train` on real MPI ranks: the contract's determinism, uneven shards, accuracy, launchers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import hpctrain, mpi_env, mpirun, summary
from hpctrain.data.reader import ShardReader
from hpctrain.data.shardformat import load_manifest
from hpctrain.compute.models import build_model

pytestmark = pytest.mark.mpi


def reference_sgd(data: Path, world: int, *, epochs: int, batch: int, lr: float) -> dict[str, torch.Tensor]:
    """One process that averages the W per-rank gradients itself (the contract's definition)."""
    shards = load_manifest(data)
    torch.manual_seed(0)
    model = build_model("mlp", shards.x_shape, shards.num_classes)
    readers = [ShardReader(shards, "train", rank=r, world=world, batch_size=batch, shuffle=False, prefetch=0)
               for r in range(world)]
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for batches in zip(*(r.epoch(epoch) for r in readers)):
            grads = []
            for b in batches:
                model.zero_grad()
                loss_fn(model(torch.from_numpy(b.x)), torch.from_numpy(b.y)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p -= lr * sum(g[i] for g in grads) / world
    return model.state_dict()


@pytest.mark.parametrize("mode", ["--overlap", "--no-overlap", "--hierarchical", "--deterministic",
                                  "--accumulate=2 --batch-size=16"])
def test_two_ranks_equal_one_process_averaging_gradients(digits2: Path, tmp_path: Path, mode: str) -> None:
    run = tmp_path / "run"
    mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--no-shuffle", "--optimizer", "sgd",
               "--momentum", "0", "--lr", "0.1", "--epochs", "2", "--batch-size", "32", *mode.split()])
    got = torch.load(run / "model.pt", weights_only=True)
    want = reference_sgd(digits2, 2, epochs=2, batch=32, lr=0.1)
    assert list(got) == list(want)  # the user's own keys, no wrapper prefix
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff <= 1e-5, diff
    s = summary(run)
    assert s["ranks_in_sync"] and s["world_size"] == 2 and s["steps"] == 2 * 23 and s["global_batch_size"] == 64


def test_uneven_shards_finish_without_hanging(tmp_path: Path) -> None:
    data = tmp_path / "d"
    hpctrain(["shard", "synthetic:39:5:3", str(data), "--shards", "4", "--val-fraction", "0"])
    counts = [e["samples"] for e in json.loads((data / "manifest.json").read_text())["splits"]["train"]["shards"]]
    assert sorted(counts) == [9, 10, 10, 10]
    run = tmp_path / "r"
    mpirun(2, ["train", "--data", str(data), "--run-dir", str(run), "--batch-size", "4", "--epochs", "3",
               "--audit-samples"], timeout=120)
    s = summary(run)
    assert s["steps"] == 15 and s["ranks_in_sync"]
    seen = np.concatenate([np.loadtxt(run / "samples" / f"rank-{r:04d}.txt", dtype=np.int64, ndmin=2) for r in range(2)])
    for epoch in range(3):
        ids = seen[seen[:, 0] == epoch, 1]
        assert sorted(ids.tolist()) == list(range(39))  # every sample exactly once per epoch, no padding


def test_digits_reaches_accuracy_on_two_ranks(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "20"])
    s = summary(run)
    assert s["val_accuracy"] >= 0.95, s
    assert s["ranks_in_sync"] and s["resumed_from"] is None
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for field in ("step", "epoch", "loss", "lr", "samples_per_s", "step_ms", "comm_ms", "data_ms"):
        assert all(field in rec for rec in lines), field
    assert lines[-1]["step"] == s["steps"]
    assert (run / "logs" / "rank-0000.log").exists() and (run / "logs" / "rank-0001.log").exists()
    torch.load(run / "model.pt", weights_only=True)


@pytest.mark.quick
def test_same_result_with_mpirun_n1_and_no_launcher(digits2: Path, tmp_path: Path) -> None:
    """Also: `train` tunes host memory and says so in its log, and opting out (HPCTRAIN_HOST_TUNING=0) changes
    that line only, not the result."""
    args = ["--data", str(digits2), "--epochs", "1", "--max-steps", "15"]
    mpirun(1, ["train", "--run-dir", str(tmp_path / "a"), *args])
    hpctrain(["train", "--run-dir", str(tmp_path / "b"), *args], env=mpi_env(HPCTRAIN_HOST_TUNING="0"))
    assert summary(tmp_path / "a")["param_sha256"] == summary(tmp_path / "b")["param_sha256"]
    assert summary(tmp_path / "b")["world_size"] == 1 and summary(tmp_path / "b")["steps"] == 15
    tuned = [line for line in (tmp_path / "a" / "logs" / "rank-0000.log").read_text().splitlines() if "host memory" in line]
    assert len(tuned) == 1 and "freed memory kept for reuse" in tuned[0] and "too late" not in tuned[0], tuned
    assert "host memory: left as it is" in (tmp_path / "b" / "logs" / "rank-0000.log").read_text()


@pytest.mark.quick
def test_launch_runs_train_on_two_ranks(digits2: Path, tmp_path: Path) -> None:
    proc = hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(tmp_path / "r"),
                     "--max-steps", "10", "--json"])
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["world_size"] == 2 and s["steps"] == 10


def test_world_size_that_does_not_divide_shards_is_refused(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "r"
    proc = mpirun(3, ["train", "--data", str(digits2), "--run-dir", str(run)], check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("cannot share them evenly") == 1  # one line, from rank 0 only
    assert "Traceback" not in proc.stderr
    assert not run.exists()


@pytest.mark.parametrize("args,needle", [(["--epochz", "3"], "error: No such option: --epochz"),
                                         (["--lr", "abc"], "error: Invalid value for '--lr'")])
def test_a_usage_error_under_mpirun_is_one_line_from_rank_0(digits2: Path, tmp_path: Path, args: list[str],
                                                             needle: str) -> None:
    """`mpirun -n 2 hpctrain train --bad` (no `hpctrain launch` to check first): before, every rank printed
    the usage box (six lines each); now rank 0 prints one line and every rank exits 2."""
    run = tmp_path / "r"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), *args], check=False)
    assert proc.returncode == 2, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if "hpctrain" in line or "rror" in line.split(":")[0]]
    assert len(ours) == 1 and needle in ours[0] and "(see `hpctrain train --help`)" in ours[0], proc.stderr
    assert "Usage:" not in proc.stderr and "Traceback" not in proc.stderr and not run.exists()


def test_the_summary_says_the_threads_and_a_resume_on_other_threads_warns(digits2: Path, tmp_path: Path) -> None:
    """CPU results depend on torch's thread count (README "Bit-exact"): the same run gave one param_sha256 with 1
    and 4 threads and another with 2, and nothing said which a run had. Now summary.json and checkpoints record
    it, and a resume on another count says that the rest is no longer bit-identical."""
    run = tmp_path / "r"
    args = ["train", "--data", str(digits2), "--run-dir", str(run), "--batch-size", "16"]
    hpctrain([*args, "--max-steps", "10"], env=mpi_env(SLURM_CPUS_PER_TASK="1"))
    assert summary(run)["torch_threads"] == 1
    proc = hpctrain([*args, "--max-steps", "20"], env=mpi_env(SLURM_CPUS_PER_TASK="2"))
    assert summary(run)["torch_threads"] == 2 and summary(run)["resumed_from"] == 10
    assert "torch threads per rank: 1 -> 2" in proc.stderr, proc.stderr


def test_summary_rates_leave_out_validation_and_checkpoint_stalls(digits2: Path, tmp_path: Path) -> None:
    """samples_per_s (and a language model's tokens_per_s and mfu) divided by a wall time that held every
    validation pass and checkpoint stall; the per-window figures did not. Both are now in summary.json."""
    run = tmp_path / "r"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "3", "--checkpoint-every", "1"])
    s = summary(run)
    assert s["paused_s"] >= s["checkpoint"]["stall_s"] > 0
    samples = 3 * json.loads((digits2 / "manifest.json").read_text())["splits"]["train"]["samples"]  # 3 epochs
    assert s["samples_per_s"] == pytest.approx(samples / (s["train_time_s"] - s["paused_s"]), rel=1e-9)
