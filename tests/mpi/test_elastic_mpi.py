"""Elastic resume: checkpointed on 4 ranks mid-epoch, resumed on 2; every sample exactly once per epoch."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import PYTHON, hpctrain, mpi_env, summary
from hpctrain.checkpoint import manager as ckpt
from hpctrain.tools.report import read_jsonl

pytestmark = pytest.mark.mpi
# paced steps (>= 25 ms): the stop sent at step 26 lands inside epoch 1 (steps 23..45) on a loaded node too
PACED = str(Path(__file__).parent / "scripts" / "paced_model.py") + ":factory"
ARGS = ["--batch-size", "16", "--epochs", "3", "--audit-samples", "--log-every", "1", "--seed", "3", "--model", PACED]


def test_four_ranks_to_two_mid_epoch(tmp_path: Path) -> None:
    data = tmp_path / "d"
    hpctrain(["shard", "digits", str(data), "--shards", "4"])
    run = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "4", "--", "train", "--data", str(data),
                             "--run-dir", str(run), *ARGS], env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        # rank 0 is appending to it: read as `hpctrain report` does (a torn last line skipped)
        lines = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if lines and lines[-1]["step"] >= 26:  # epoch 1 has steps 23..45 on 4 ranks
            break
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=90)
    assert proc.returncode == 3
    meta = ckpt.verify(ckpt.latest(run))
    assert meta["world_size"] == 4 and meta["epoch"] == 1 and 0 < meta["step_in_epoch"] < 23

    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(data), "--run-dir", str(run), *ARGS])
    s = summary(run)
    assert s["world_size"] == 2 and s["ranks_in_sync"] and s["resumed_from"] == meta["step"]

    seen: dict[int, Counter] = {}
    for path in sorted((run / "samples").glob("rank-*.txt")):
        rows = np.loadtxt(path, dtype=np.int64, ndmin=2)
        for epoch, sample in rows:
            seen.setdefault(int(epoch), Counter())[int(sample)] += 1
    train_ids = set()
    import h5py

    for f in sorted((data / "train").iterdir()):
        with h5py.File(f, "r") as h5:
            train_ids.update(h5["index"][()].tolist())
    assert sorted(seen) == [0, 1, 2]
    for epoch, counts in seen.items():
        assert set(counts) == train_ids, epoch
        assert max(counts.values()) == 1, (epoch, [k for k, v in counts.items() if v > 1][:5])
