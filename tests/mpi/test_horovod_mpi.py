"""hpctrain.horovod under a real mpirun: the semantics a thin wrapper over mpi4py would not give (names matched
across ranks, errors on every rank, join, async handles, the optimizer's average), and the stall inspector
ending a job whose rank never submits a tensor. Horovod's own suite: tests/peers."""

import time
from pathlib import Path

import pytest

from conftest import mpi_env, mpirun

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.mpi
def test_names_errors_join_and_the_optimizer_behave_as_horovods() -> None:
    proc = mpirun(2, [str(SCRIPTS / "hvd_semantics.py")], python_module=False, timeout=120)
    assert proc.stdout.count("SEMANTICS OK") == 2, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_a_tensor_one_rank_never_submits_is_reported_by_name_and_the_job_ends() -> None:
    env = mpi_env(HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3")
    start = time.monotonic()
    proc = mpirun(2, [str(SCRIPTS / "hvd_stall.py")], python_module=False, timeout=60, check=False, env=env)
    assert proc.returncode != 0 and "NOT REACHED" not in proc.stdout
    assert time.monotonic() - start < 30
    assert "allreduce 'allreduce.never' submitted by rank(s) [0], missing on rank(s) [1]" in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_sync_batch_norm_equals_one_batch_norm_and_elastic_resumes_from_its_commit(tmp_path: Path) -> None:
    env = mpi_env(HPCTRAIN_ELASTIC_DIR=str(tmp_path / "elastic"))
    first = mpirun(2, [str(SCRIPTS / "hvd_bn_elastic.py"), "first"], python_module=False, timeout=120, env=env)
    assert first.stdout.count("BN OK") == 2 and first.stdout.count("ELASTIC OK") == 2, first.stdout + first.stderr
    second = mpirun(2, [str(SCRIPTS / "hvd_bn_elastic.py"), "second"], python_module=False, timeout=120, env=env)
    assert second.stdout.count("ELASTIC OK") == 2 and " 2 4" in second.stdout, second.stdout + second.stderr
