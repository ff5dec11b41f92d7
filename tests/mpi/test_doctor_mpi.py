"""`hpctrain doctor` under real `mpirun -n 1` and `-n 2` on this machine's Open MPI (not CUDA-aware).

Every rank checks itself and rank 0 prints the gathered report once; `--strict` fails every rank when any rank
has a problem. The library call is also bound to COMM_SELF and COMM_WORLD, asserting facts true at any count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap

import pytest

from conftest import mpi_env, mpirun

pytestmark = pytest.mark.mpi

CPUS = len(os.sched_getaffinity(0))


def _env(**extra: str) -> dict[str, str]:
    env = mpi_env(**extra)
    for name in ("CUDA_VISIBLE_DEVICES", "HDF5_USE_FILE_LOCKING", "SLURM_JOB_ID", "SLURM_STEP_ID",
                 "SLURM_NTASKS", "SLURM_CPUS_PER_TASK", "SLURM_PROCID", *(() if "OMP_NUM_THREADS" in extra
                                                                         else ("OMP_NUM_THREADS",))):
        env.pop(name, None)
    return env


def _built_with_cuda() -> bool:
    ompi_info = shutil.which("ompi_info")
    assert ompi_info, "ompi_info missing: install openmpi-bin"
    out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True).stdout
    return re.search(r"mpi_built_with_cuda_support:value:(\w+)", out).group(1) == "true"


def _report(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"rank 0 alone should print one report:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0])


@pytest.mark.parametrize("n, threads", [(1, None), (2, "1")])
def test_doctor_on_every_rank(n: int, threads: str | None) -> None:
    env = _env(**({"OMP_NUM_THREADS": threads} if threads else {}))
    report = _report(mpirun(n, ["doctor", "--json", "--strict"], env=env, timeout=180))
    assert report["world_size"] == n and report["ok"] is True and report["problems"] == []
    assert [r["rank"] for r in report["ranks"]] == list(range(n))
    aware = _built_with_cuda()
    for r in report["ranks"]:
        assert r["mpi"]["world_size"] == n and r["mpi"]["rank"] == r["rank"]
        assert r["mpi"]["cuda_aware"] is aware is False  # Debian's Open MPI: no CUDA, and doctor says so
        assert r["mpi"]["thread_level"] == "multiple"
        launcher = r["launcher"]
        assert (launcher["name"], launcher["world_size"], launcher["local_rank"], launcher["local_size"]) == (
            "mpirun", n, r["rank"], n)
        assert r["gpus"]["device"] == "cpu"
        assert r["torch"]["cpus_owned"] == max(1, CPUS // n)
        assert r["problems"] == []


def test_strict_fails_every_rank_when_ranks_oversubscribe_the_cores() -> None:
    """As many torch threads as CPUs on each of 2 ranks: a real problem here, reported once with its ranks."""
    if CPUS < 2:
        pytest.skip("needs 2 CPUs, so that 2 ranks with one thread per CPU oversubscribe them")
    proc = mpirun(2, ["doctor", "--json", "--strict"], env=_env(OMP_NUM_THREADS=str(CPUS)), check=False,
                  timeout=180)
    assert proc.returncode != 0
    report = _report(proc)
    assert report["ok"] is False
    owned = max(1, CPUS // 2)
    threads = report["ranks"][0]["torch"]["threads"]
    assert threads > owned
    [problem] = report["problems"]
    assert problem["check"] == "torch-threads" and problem["ranks"] == [0, 1]
    assert problem["message"].startswith(f"torch would use {threads} threads but this rank owns {owned} CPU(s)")
    assert problem["fix"].startswith(f"export OMP_NUM_THREADS={owned} ")
    assert "Traceback" not in proc.stderr


SCRIPT = textwrap.dedent("""\
    from hpctrain.comm import self_comm, world
    from hpctrain.tools.doctor import doctor

    comm_world = world()
    for comm in (self_comm(), comm_world):
        report = doctor(comm)
        assert report["world_size"] == comm.size, report
        assert [r["rank"] for r in report["ranks"]] == (
            [comm_world.rank] if comm.size == 1 else list(range(comm.size)))
        for r in report["ranks"]:
            assert r["mpi"]["world_size"] == comm_world.size
            assert r["mpi"]["cuda_aware"] is False
            assert "launcher" not in {p["check"] for p in r["problems"]}
    comm_world.barrier()
    if comm_world.rank == 0:
        print("DOCTOR OK", comm_world.size)
    """)


@pytest.mark.parametrize("n", [2])
def test_library_call_bound_to_comm_self_and_comm_world(n: int, tmp_path) -> None:
    script = tmp_path / "doctor_check.py"
    script.write_text(SCRIPT)
    proc = mpirun(n, [str(script)], python_module=False, env=_env(OMP_NUM_THREADS="1"), timeout=180)
    assert f"DOCTOR OK {n}" in proc.stdout
