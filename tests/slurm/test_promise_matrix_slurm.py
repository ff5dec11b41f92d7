"""The srun row of the promise matrix (#54; the matrix and its other rows: tests/mpi/test_promise_matrix_mpi.py):
`srun --mpi=pmix python -m hpctrain train` on the local cluster's two nodes, no launcher of hpctrain's.

Slurm stops a job by signalling its tasks (`scancel --signal=INT|TERM|USR2`, a preemption's SIGTERM): each
checkpoints and exits 3, and the run records who asked. A SIGTERM to srun itself is srun's own order to kill the
step ("forcing job termination": the tasks get SIGKILL), so the matrix sends the signals where Slurm sends them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import mpi_env, summary
from hpctrain.checkpoint import manager as ckpt
from hpctrain.tools.report import read_jsonl

from slurm_util import cluster_session, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STOP_ARGS = ["--model", "mlp:64", "--batch-size", "8", "--max-steps", "150", "--log-every", "1", "--seed", "3"]
EXACT_ARGS = ["--model", "mlp:64", "--batch-size", "8", "--max-steps", "12", "--checkpoint-every", "5",
              "--seed", "3"]


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, up for the whole session (started and stopped here unless it already ran)."""
    yield from cluster_session()


def srun_argv(n: int, name: str, data: Path, run: Path, *args: str) -> list[str]:
    # --quiet: srun's own notes ("job N queued and waiting for resources") would come before the run's lines
    return ["srun", "--quiet", "-N", str(n), "-n", str(n), "--mpi=pmix", "-J", name, sys.executable, "-m",
            "hpctrain", "train", "--data", str(data), "--run-dir", str(run), *args]


def srun(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("sig,asked_by", [(signal.SIGINT, "user"), (signal.SIGTERM, "scheduler"),
                                          (signal.SIGUSR2, "scheduler")], ids=["INT", "TERM", "USR2"])
def test_scancel_signal_to_the_tasks_of_srun_checkpoints_and_exits_3(slurm_cluster, digits2: Path, tmp_path: Path,
                                                                     sig: signal.Signals, asked_by: str) -> None:
    run, name = tmp_path / "run", f"promise-{tmp_path.name}"
    proc = subprocess.Popen(srun_argv(2, name, digits2, run, *STOP_ARGS), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpi_env(HPCTRAIN_TEST_STRAGGLER="0:0.03"))

    def at_step_30() -> bool:
        assert proc.poll() is None, proc.communicate()
        lines = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        return bool(lines) and lines[-1]["step"] >= 30

    wait_for(at_step_30, 180, "step 30", poll=0.05)
    job = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout.split()[0]
    subprocess.run(["scancel", f"--signal={sig.name[3:]}", job], check=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (proc.returncode, err)
    assert f"stopped by {sig.name} at step" in err and "Traceback" not in err, err
    step = ckpt.verify(ckpt.latest(run))["step"]
    record = json.loads((run / "stopped.json").read_text())
    assert record == {**record, "step": step, "signal": sig.name, "asked_by": asked_by}, record
    assert 30 <= step < 150


def test_srun_resumed_from_a_periodic_checkpoint_ends_bit_identical(slurm_cluster, digits2: Path,
                                                                   tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = srun_argv(2, f"promise-{tmp_path.name}", digits2, run, *EXACT_ARGS)
    srun(argv)
    straight = summary(run)
    assert straight["steps"] == 12 and straight["world_size"] == 2, straight
    shutil.rmtree(run / "checkpoints" / "step-0000012")
    proc = srun(argv)
    assert proc.stderr.splitlines()[0].startswith("resumed from step 10 ("), proc.stderr
    assert (summary(run)["resumed_from"], summary(run)["param_sha256"]) == (10, straight["param_sha256"])


def test_srun_on_another_world_size_trains_each_sample_once_and_says_so(slurm_cluster, digits2: Path,
                                                                       tmp_path: Path) -> None:
    """Cut after 5 steps on both nodes, continued on one task with a changed learning rate."""
    run, name = tmp_path / "run", f"promise-{tmp_path.name}"
    srun(srun_argv(2, name, digits2, run, "--max-steps", "5", "--audit-samples"))
    proc = srun(srun_argv(1, name, digits2, run, "--epochs", "1", "--lr", "0.02", "--audit-samples"))
    first = proc.stderr.splitlines()[0]
    assert first.startswith("resumed from step 5 ("), proc.stderr
    for change in ("world size 2 -> 1", "global batch 64 -> 32", "lr: 0.05 -> 0.02"):
        assert change in first, (change, first)
    ids = [line.split()[1] for f in sorted((run / "samples").glob("rank-*.txt"))
           for line in f.read_text().splitlines() if line.split()[0] == "0"]
    n_train = json.loads((digits2 / "manifest.json").read_text())["splits"]["train"]["samples"]
    assert len(ids) == n_train and len(set(ids)) == n_train, (len(ids), len(set(ids)), n_train)
    assert summary(run)["epochs"] == 1, summary(run)
