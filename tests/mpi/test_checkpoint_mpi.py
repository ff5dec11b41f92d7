"""Checkpoint/restart on real processes: signals, kill -9, exact resume, atomic saves."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, hpctrain, mpi_env, summary
from hpctrain.checkpoint import manager as ckpt
from hpctrain.checkpoint.format import part_name
from hpctrain.tools.report import read_jsonl

pytestmark = pytest.mark.mpi

# dropout, shuffling and adam: every source of state a resume must restore
ARGS = ["--model", "mlp:256,256:dropout=0.2", "--optimizer", "adam", "--lr", "0.002", "--batch-size", "8",
        "--epochs", "6", "--log-every", "1", "--seed", "7"]


# Runs that a test signals or kills mid-training are paced: rank 0 sleeps 10 ms before each step (the test hook
# of base/rankenv.py; sleeping changes no number), so a signal sent at step 100 lands with seconds of training
# left. Unpaced, the 440 steps after step 100 take well under a second on an idle machine, and CI once saw the
# run end (exit 0) before the SIGTERM sent at step 100 arrived.
PACED = "0:0.01"


def launch(data: Path, run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(data),
                             "--run-dir", str(run), *ARGS, *extra], env=mpi_env(HPCTRAIN_TEST_STRAGGLER=PACED),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    path = run / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()}")
        if path.exists():  # rank 0 is appending to it: read as `hpctrain report` does (a torn last line skipped)
            lines = read_jsonl(path)
            if lines and lines[-1]["step"] >= step:
                return lines[-1]["step"]
        time.sleep(0.01)
    raise AssertionError(f"step {step} not reached")


def rank_pid(run: Path, rank: int) -> int:
    text = (run / "logs" / f"rank-{rank:04d}.log").read_text()
    return int(re.search(r"pid (\d+)", text).group(1))


@pytest.fixture(scope="module")
def reference(digits2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same run, uninterrupted."""
    run = tmp_path_factory.mktemp("ref") / "run"
    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), *ARGS, "--audit-samples"])
    return dict(summary(run), run=run)


@pytest.mark.parametrize("target", ["launcher", "rank"])
def test_sigterm_mid_epoch_then_resume_is_bit_identical(digits2: Path, tmp_path: Path, reference: dict, target: str) -> None:
    run = tmp_path / "run"
    proc = launch(digits2, run, "--audit-samples")
    wait_for_step(run, 100, proc)
    os.kill(proc.pid if target == "launcher" else rank_pid(run, 1), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "checkpoint written to" in err and "run the same command to continue" in err
    assert "error: stopped" not in err  # a stop is not reported as a failure
    assert "Forwarding signal" not in err and "Primary job" not in err, err  # nor drowned in mpirun's text
    if target == "launcher":
        assert "hpctrain launch: SIGTERM: every rank writes a checkpoint at its next step and stops" in err
    latest = ckpt.latest(run)
    meta = ckpt.verify(latest)
    assert meta["step"] >= 100 and meta["step"] < reference["steps"]
    assert not (run / "summary.json").exists()
    # each rank wrote about half of the (replicated) model and optimizer bytes
    sizes = [(latest / part_name(r)).stat().st_size for r in range(2)]
    assert meta["parts"] == 2 and min(sizes) > 0.8 * max(sizes), sizes
    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), *ARGS,
              "--audit-samples"])
    resumed = summary(run)
    assert resumed["resumed_from"] == meta["step"]
    assert resumed["param_sha256"] == reference["param_sha256"]
    # the audit after resume is exactly the uninterrupted one: nothing past the checkpoint kept twice
    for r in range(2):
        name = f"samples/rank-{r:04d}.txt"
        assert (run / name).read_text() == (reference["run"] / name).read_text()
    epochs: dict[int, list[int]] = {}
    for r in range(2):
        for line in (run / "samples" / f"rank-{r:04d}.txt").read_text().splitlines():
            e, i = map(int, line.split())
            epochs.setdefault(e, []).append(i)
    assert sorted(epochs) == list(range(6))
    assert all(len(set(v)) == len(v) == 1438 for v in epochs.values())


def test_kill_9_one_rank_ends_job_and_resume_is_bit_identical(digits2: Path, tmp_path: Path, reference: dict) -> None:
    run = tmp_path / "run"
    proc = launch(digits2, run, "--checkpoint-every", "40")
    wait_for_step(run, 130, proc)
    killed_at = time.time()
    os.kill(rank_pid(run, 1), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.time() - killed_at < 30
    step = ckpt.verify(ckpt.latest(run))["step"]
    assert step >= 80
    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), *ARGS,
              "--checkpoint-every", "40"])
    resumed = summary(run)
    assert resumed["resumed_from"] == step
    assert resumed["param_sha256"] == reference["param_sha256"]
    metrics = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics == sorted(set(metrics))  # no duplicated steps from the killed attempt
    assert len(ckpt.list_checkpoints(run)) == 2  # --keep 2


SAVER = r"""
import os, sys, torch
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.comm import Comm
for line in sys.stdin:  # one forked saver per line; torch is imported once
    base = int(line)
    pid = os.fork()
    if pid == 0:
        mgr = CheckpointManager(sys.argv[1], Comm(None), every=1, keep=2)  # one process, no MPI: forks cleanly
        state = {"w": torch.randn(3_000_000)}
        step = base
        while True:
            step += 1
            state["w"] += 1
            mgr.save(step, dict(model_state=state, train_state={"step": step}, rank_state={"r": 0}, meta={"step": step}),
                     final=True)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("dead", flush=True)
"""


def test_kill_9_during_saves_never_leaves_a_broken_listed_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = random.Random(0)
    loaded = 0
    server = subprocess.Popen([PYTHON, "-c", SAVER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=mpi_env(), text=True)
    try:
        for attempt in range(20):
            server.stdin.write(f"{attempt * 1000}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0.02, 0.5))
            os.kill(pid, signal.SIGKILL)
            assert server.stdout.readline().strip() == "dead"
            for path in ckpt.list_checkpoints(run):
                state = ckpt.load_files(path)  # raises if anything listed is incomplete or corrupt
                assert state["meta"]["step"] == int(path.name[5:])
                loaded += 1
    finally:
        server.kill()
    assert loaded > 0


def test_corrupt_latest_falls_back_to_previous(tmp_path: Path, digits2: Path) -> None:
    run = tmp_path / "run"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "30", "--checkpoint-every", "10",
              "--keep", "3"])
    steps = [int(p.name[5:]) for p in ckpt.list_checkpoints(run)]
    assert steps == [30, 20, 10]
    with open(run / "checkpoints" / "step-0000030" / "part-00000.bin", "r+b") as fh:
        fh.truncate(100)
    proc = hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "40"])
    assert "damaged checkpoint" in proc.stderr
    assert summary(run)["resumed_from"] == 20


def test_on_resume_only_rank_0_reads_and_verifies_the_checkpoints(tmp_path: Path, digits2: Path) -> None:
    run = tmp_path / "run"
    base = ["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), "--checkpoint-every", "10",
            "--keep", "3"]
    hpctrain([*base, "--max-steps", "30"])
    with open(run / "checkpoints" / "step-0000030" / part_name(1), "r+b") as fh:  # rank 1's part
        fh.truncate(100)
    proc = hpctrain([*base, "--max-steps", "40"])
    assert "damaged checkpoint" in proc.stderr
    assert summary(run)["resumed_from"] == 20
    logs = [(run / "logs" / f"rank-{r:04d}.log").read_text() for r in range(2)]
    assert "damaged checkpoint" in logs[0] and "damaged checkpoint" not in logs[1]  # rank 1 never looked


def test_resume_against_another_dataset_is_refused(tmp_path: Path, digits2: Path) -> None:
    run = tmp_path / "run"
    hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "5"])
    other = tmp_path / "other"
    hpctrain(["shard", "synthetic:200:64:10", str(other), "--shards", "2"])
    proc = hpctrain(["train", "--data", str(other), "--run-dir", str(run), "--max-steps", "10"], check=False)
    assert proc.returncode == 2 and "another dataset" in proc.stderr
    proc = hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "10", "--lr", "0.01"])
    assert "lr: 0.05 -> 0.01" in proc.stderr


def test_watchdog_aborts_a_hung_collective_and_names_the_rank(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = launch(digits2, run, "--collective-timeout", "4", "--epochs", "40")
    wait_for_step(run, 20, proc)
    stuck = rank_pid(run, 1)
    time.sleep(1.5)  # let it beat once
    os.kill(stuck, signal.SIGSTOP)  # alive but never arriving: the hang a dead NIC or a deadlock gives
    started = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        try:
            os.kill(stuck, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0
    assert time.time() - started < 30
    assert re.search(r"rank 0: .* has waited \d+ s .*rank 1 \(silent", err), err[-2000:]
    assert "rank 0" in (run / "logs" / "rank-0000.log").read_text().split("aborting")[0]
