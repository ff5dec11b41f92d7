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
    train(TrainConfig.flat(data=data, run_dir=run, schedule=schedule, max_steps=max_steps, epochs=5, batch_size=10,
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
    cfg = TrainConfig.flat(data=data, run_dir=run, schedule="cosine", max_steps=3, batch_size=10, lr=0.125,
                      model="mlp:16,8:dropout=0.1", checkpoint_every="auto", progress=False, json=True)
    train(cfg, comm=Comm(None))
    text = (run / "config.toml").read_text()
    assert {"run", "data", "optimizer", "checkpoint"} <= set(read_toml(text))
    again = TrainConfig.flat(**read_train_toml(text))
    assert again.to_dict() == cfg.to_dict()


def test_a_resume_says_so_first_and_a_finished_run_says_nothing_is_left(data: Path, tmp_path: Path, capsys) -> None:
    """Before: a resumed run never said on the console that it resumed, nor from which step, nor that the run
    was already complete (the same summary printed again, as if it had trained)."""
    run = tmp_path / "r"
    _run(data, run, "constant", 10)
    assert "resumed" not in capsys.readouterr().err
    _run(data, run, "constant", 10)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"resumed from step 10 ({run / 'checkpoints' / 'step-0000010'})", err
    assert err[1].startswith("nothing left to do: step 10 is this run's last (of 10); raise --epochs or --max-steps")
    _run(data, run, "constant", 15)
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("; the run now ends at step 15 (it was planned to 10)") and "nothing left" not in err[1:]


def test_the_console_line_counts_epochs_from_1_and_shows_a_language_model_s_figures() -> None:
    from hpctrain.control.runlog import console_line

    record = {"loss": 0.5, "samples_per_s": 1000.0, "val_loss": 0.25, "val_accuracy": 0.9}
    assert console_line(record, 19, 400, 400) == "epoch 20 step 400/400  loss 0.5000  val_loss 0.2500  " \
                                                 "val_accuracy 0.9000  1000 samples/s"
    lm = {"loss": 2.0, "samples_per_s": 10.0, "tokens_per_s": 640.0, "mfu": 0.01, "val_loss": 1.5,
          "val_accuracy": 0.4, "val_bits_per_byte": 2.16, "val_perplexity": 4.48}
    assert console_line(lm, 0, 10, 20) == "epoch 1 step 10/20  loss 2.0000  val_loss 1.5000  " \
                                          "val_bits_per_byte 2.1600  val_perplexity 4.4800  640 tokens/s"
