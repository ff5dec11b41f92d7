"""slurm/cluster.sh, the local cluster the Slurm tests and `make slurm-up` use: its answers that need no daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[2] / "slurm" / "cluster.sh"


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm client here: status would not reach sinfo")
def test_status_of_a_cluster_whose_daemons_are_not_running_answers_at_once(tmp_path: Path) -> None:
    """A state folder with no daemon running is a stopped cluster, whatever another slurmctld on the host says:
    `status` exits 1 at once (it used to ask sinfo, which retries a stopped slurmctld for about 20 s, and which
    answers for another cluster when one runs), so the Slurm tests' first set-up does not wait on it."""
    start = time.monotonic()
    proc = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, HPCTRAIN_SLURM_STATE=str(tmp_path)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "slurmctld: stopped" in proc.stdout and time.monotonic() - start < 5
