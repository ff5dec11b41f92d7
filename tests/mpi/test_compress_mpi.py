"""PowerSGD and top-k gradient compression on real MPI ranks: ranks stay bit-identical, the payload shrinks,
the error feedback is in checkpoints (exact resume), and every wire format reports its bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import hpctrain, mpirun, summary

pytestmark = pytest.mark.mpi
ARGS = ["--model", "mlp:256,256", "--batch-size", "16", "--seed", "2", "--epochs", "50", "--json"]


def train(n: int, data: Path, run: Path, *args: str) -> dict:
    hpctrain(["launch", "-n", str(n), "--", "train", "--data", str(data), "--run-dir", str(run), *ARGS, *args])
    return summary(run)


@pytest.mark.parametrize("wire, at_most", [("powersgd:2", 1 / 20), ("topk:0.01", 1 / 20), ("fp16", 0.5),
                                           ("bf16", 0.5)])
def test_a_compressed_run_stays_in_sync_and_sends_fewer_bytes(tmp_path: Path, digits2: Path, wire: str,
                                                              at_most: float) -> None:
    plain = train(2, digits2, tmp_path / "none", "--max-steps", "40")
    s = train(2, digits2, tmp_path / "c", "--max-steps", "40", "--grad-compression", wire)
    assert s["ranks_in_sync"] and s["grad_compression"] == wire
    assert plain["wire_bytes_per_step"] == 4 * (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)
    assert 0 < s["wire_bytes_per_step"] <= at_most * plain["wire_bytes_per_step"]
    assert s["val_accuracy"] > 0.5  # it learns


@pytest.mark.parametrize("wire", ["powersgd:2", "topk:0.05"])
def test_the_error_feedback_is_checkpointed_for_an_exact_resume(tmp_path: Path, digits2: Path, wire: str) -> None:
    straight = train(2, digits2, tmp_path / "straight", "--max-steps", "30", "--grad-compression", wire)
    run = tmp_path / "resumed"
    train(2, digits2, run, "--max-steps", "15", "--grad-compression", wire)
    resumed = train(2, digits2, run, "--max-steps", "30", "--grad-compression", wire)
    assert resumed["resumed_from"] == 15 and resumed["param_sha256"] == straight["param_sha256"]


def test_compression_that_needs_whole_gradients_is_refused_with_zero(tmp_path: Path, digits2: Path) -> None:
    proc = hpctrain(["train", "--data", str(digits2), "--run-dir", str(tmp_path / "r"), "--zero", "2",
                     "--grad-compression", "powersgd:4"], check=False)
    assert proc.returncode != 0 and "does not combine with --zero 2" in proc.stderr
    proc = hpctrain(["train", "--data", str(digits2), "--run-dir", str(tmp_path / "r"), "--grad-compression",
                     "topk:2"], check=False)
    assert proc.returncode != 0 and "topk[:FRACTION]" in proc.stderr and "Traceback" not in proc.stderr


def test_fp16_overflow_with_powersgd_or_topk_skips_one_step_and_keeps_learning() -> None:
    """The error feedback used to store the overflowed (inf/NaN) gradient: every later step was skipped and the
    loss scale halved towards 0, silently; and it stored scaled gradients, wrong once the scale changed."""
    proc = mpirun(2, [str(Path(__file__).parent / "scripts" / "compress_scaler_check.py")], python_module=False,
                  timeout=120)
    assert proc.stdout.count("COMPRESS SCALER OK") == 2, proc.stdout + proc.stderr
