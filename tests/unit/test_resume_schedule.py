"""Resuming with other --epochs/--max-steps replans the learning-rate schedule, and says so.

In-process runs on a world of one (`Comm(None)`, no MPI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.comm import Comm
from hpctrain.base.config import ShardConfig, TrainConfig
from hpctrain.data.sharding import shard
from hpctrain.control.trainer import train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sched") / "d"
    shard(ShardConfig(source="synthetic:200:8:3", out=out, shards=1, val_fraction=0), show_progress=False,
          comm=Comm(None))
    return out


def _run(data: Path, run: Path, schedule: str, max_steps: int) -> None:
    train(TrainConfig(data=data, run_dir=run, schedule=schedule, max_steps=max_steps, epochs=5, batch_size=10,
                      progress=False, json=True), comm=Comm(None))


def test_longer_resume_of_a_cosine_run_warns_and_follows_the_new_plan(data: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "r"
    _run(data, run, "cosine", 10)
    capsys.readouterr()
    _run(data, run, "cosine", 30)
    err = capsys.readouterr().err
    assert "planned over 10 steps and now spans 30" in err, err
    lrs = {rec["step"]: rec["lr"] for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert lrs[30] == pytest.approx(0.0, abs=1e-12)  # the new plan ends at step 30
    assert lrs[20] > 0.0


def test_same_plan_or_constant_schedule_resumes_silently(data: Path, tmp_path: Path, capsys) -> None:
    _run(data, tmp_path / "c", "constant", 10)
    _run(data, tmp_path / "c", "constant", 20)
    _run(data, tmp_path / "s", "cosine", 10)
    _run(data, tmp_path / "s", "cosine", 10)
    assert "schedule" not in capsys.readouterr().err


def test_config_toml_beside_the_run_rebuilds_the_same_config(data: Path, tmp_path: Path) -> None:
    """config.toml is written by tomli-w, in [sections], and read by tomllib: every value round-trips, so
    `hpctrain train --config RUN/config.toml` repeats the run."""
    from hpctrain.base.config import read_toml, read_train_toml

    run = tmp_path / "r"
    cfg = TrainConfig(data=data, run_dir=run, schedule="cosine", max_steps=3, batch_size=10, lr=0.125,
                      model="mlp:16,8:dropout=0.1", checkpoint_every="auto", progress=False, json=True)
    train(cfg, comm=Comm(None))
    text = (run / "config.toml").read_text()
    assert {"run", "data", "optimizer", "checkpoint"} <= set(read_toml(text))
    again = TrainConfig(**read_train_toml(text))
    assert again.to_dict() == cfg.to_dict()
