"""The straggler verdict of a pipelined run with data parallelism (`--pp 2`, D = 2, 4 ranks; #54 item 8).

Stage 0 is ranks 0-1, stage 1 ranks 2-3; replica d is the pipeline (d, d + 2). A rank slowed in its data path
makes its replica's rank in the other stage wait for it through the pipeline, which then arrives as late at
its own stage's gradient sum: by arrival alone the two tie, and the verdict named the wrong one ("rank 3 ...
in no traced phase" for a slowed rank 1) or none. Blamed by arrival less each rank's waits for a neighbour
stage, the slowed rank is named, in its data wait. The sleep (60 ms a step, a step of this MLP takes a few) is
strong on purpose, so that the verdict cannot be noise on a busy machine; `benchmarks/trace_verdicts.py --pp 2`
measures the realistic case (1.5 times as slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import mpi_env, mpirun, summary

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("slowed", [1, 2])  # one rank of each stage
def test_the_slowed_rank_of_a_pipeline_with_replicas_is_named(digits2: Path, tmp_path: Path, slowed: int) -> None:
    run = tmp_path / "run"
    mpirun(4, ["train", "--data", str(digits2), "--run-dir", str(run), "--model", "mlp:64,64", "--pp", "2",
               "--batch-size", "16", "--max-steps", "16", "--trace", "3:14", "--checkpoint-every", "0"],
           timeout=240, env=mpi_env(HPCTRAIN_TEST_STRAGGLER=f"{slowed}:0.06"))
    found = summary(run)["straggler"]
    assert found["stages"] == 2 and found["steps"] == 12, found
    assert found["rank"] == slowed and found["phase"] == "data wait", found
    assert found["verdict"].startswith(f"rank {slowed} is the straggler: data wait"), found
    # the replica's rank in the other stage waited for it through the pipeline: that is no blame of its own
    partner = (slowed + 2) % 4
    assert found["made_others_wait_ms_per_step"][str(partner)] < 0.25 * found["made_others_wait_ms_per_step"][str(slowed)]
