"""ZeRO 3's memory promise holds for the whole run, not only for training (issue 54, item 12): writing the final
model (RUN/model.pt) never holds the whole model on one rank, so no rank's peak RSS at the end of the run is above
the training peak summary.json records (the largest rank's, taken before the final model)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import mpirun, summary

pytestmark = pytest.mark.mpi

# 8 layers of 1024 (7.4 M parameters, 29.6 MB in fp32; its largest tensor 4 MB): the whole model is many times
# what one gathered unit and one tensor's copy add
MODEL = "mlp:" + ",".join(["1024"] * 8)
# every rank's peak RSS when its process ends, written beside the run (KiB on Linux)
PEAK_AT_EXIT = textwrap.dedent("""
    import atexit, os, resource, runpy, sys
    out = sys.argv.pop(1)
    rank = os.environ["OMPI_COMM_WORLD_RANK"]
    atexit.register(lambda: open(f"{out}/peak-{rank}", "w").write(
        str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
    sys.argv[0] = "hpctrain"
    runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
""")


def test_zero3_run_ends_within_its_training_peak(digits2, tmp_path):
    run = tmp_path / "run"
    mpirun(2, ["-c", PEAK_AT_EXIT, str(tmp_path), "train", "--data", str(digits2), "--run-dir", str(run),
               "--model", MODEL, "--zero", "3", "--optimizer", "adam", "--batch-size", "32", "--max-steps", "3",
               "--checkpoint-every", "0", "--json"], python_module=False, timeout=600)
    got = summary(run)
    model_bytes = sum(t.numel() * t.element_size() for t in torch.load(run / "model.pt", weights_only=True).values())
    assert model_bytes > 29e6 and got["zero"] == 3
    training = got["memory"]["peak_rss"]
    ends = {rank: int((tmp_path / f"peak-{rank}").read_text()) for rank in (0, 1)}
    over = {rank: peak - training for rank, peak in ends.items()}
    # a quarter of the model: far below the whole model on one rank, above one unit and one tensor's copy
    assert max(over.values()) < model_bytes / 4, json.dumps({"model_bytes": model_bytes, "training_peak": training,
                                                             "end_peaks": ends, "over": over})
