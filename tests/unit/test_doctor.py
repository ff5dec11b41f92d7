"""`hpctrain doctor`: the checks as a pure function of facts, and the command on this machine's real MPI.

This machine's Open MPI (Debian's 4.1) is not CUDA-aware and it has no GPU; the doctor must say exactly that.
GPU situations that cannot happen here are checked by handing `problems()` the facts a GPU node would report.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from typing import Any

import pytest

from hpctrain.tools.doctor import format_report, problems
from hpctrain.data.hdf5env import file_locking

from conftest import hpctrain, mpi_env

# What a healthy single rank on a CPU machine reports.
BASE: dict[str, Any] = {
    "rank": 0, "host": "n1", "python": "3.11.2", "hpctrain": "0.1.0",
    "mpi": {"library": "Open MPI v5.0.10, package: Open MPI root@build Distribution, ident: 5.0.10",
            "mpi_version": "3.1", "mpi4py": "4.1.2", "thread_level": "multiple", "cuda_aware": False,
            "rank": 0, "world_size": 1},
    "launcher": {"name": "none", "rank": None, "world_size": None, "local_rank": 0, "local_size": 1,
                 "slurm_job_id": None, "node": None, "cpus_per_task": None, "restart_count": 0},
    "gpus": {"cuda_visible_devices": None, "visible": 0, "device": "cpu", "device_error": None},
    "hdf5": {"h5py": "3.16.0", "hdf5": "2.0.0", "file_locking": "best-effort", "source": "HDF5 default",
             "raw": None, "valid": True},
    "torch": {"version": "2.13.0+cpu", "cuda": None, "gpus": 0, "threads": 2, "cpus_owned": 2,
              "cpus_available": 2},
}


def facts(**changes: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    for key, value in changes.items():
        out[key].update(value)
    return out


def checks(f: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {p["check"]: p for p in problems(f)}


GPU_NODE = dict(gpus={"cuda_visible_devices": "0,1,2,3", "visible": 4, "device": "cuda:0"},
                torch={"version": "2.13.0+cu129", "cuda": "12.9", "gpus": 4})


def test_a_healthy_cpu_rank_has_no_problem() -> None:
    assert problems(facts()) == []


def test_non_cuda_aware_mpi_is_a_problem_only_with_gpus() -> None:
    assert "cuda-aware" not in checks(facts())
    problem = checks(facts(**GPU_NODE))["cuda-aware"]
    assert problem["message"].startswith("4 GPU(s) visible but Open MPI v5.0.10 is not CUDA-aware")
    assert "hpctrain container recipe --mode hybrid" in problem["fix"]
    assert "cuda-aware" not in checks(facts(mpi={"cuda_aware": True}, **GPU_NODE))
    unknown = checks(facts(mpi={"cuda_aware": None}, **GPU_NODE))["cuda-aware"]
    assert "cannot say whether it is CUDA-aware" in unknown["message"]


def test_thread_level_below_multiple() -> None:
    problem = checks(facts(mpi={"thread_level": "funneled"}))["thread-level"]
    assert "MPI_THREAD_FUNNELED" in problem["message"] and "--enable-mt" in problem["fix"]


def test_srun_without_pmix_leaves_every_task_alone() -> None:
    f = facts(launcher={"name": "srun", "rank": 3, "world_size": 4, "slurm_job_id": "77", "node": "n2"},
              mpi={"world_size": 1})
    problem = checks(f)["launcher"]
    assert problem["message"] == "srun started 4 tasks but MPI sees a world of 1: every task trains alone"
    assert "srun --mpi=pmix" in problem["fix"]
    assert "launcher" not in checks(facts(launcher={"name": "srun", "world_size": 4}, mpi={"world_size": 4}))


def test_torch_threads_against_the_cpus_this_rank_owns() -> None:
    problem = checks(facts(torch={"threads": 8, "cpus_owned": 2, "cpus_available": 8},
                           launcher={"local_size": 4}))["torch-threads"]
    assert problem["message"].startswith("torch would use 8 threads but this rank owns 2 CPU(s) (4 rank(s) on 8")
    assert problem["fix"].startswith("export OMP_NUM_THREADS=2")


def test_srun_that_did_not_inherit_cpus_per_task() -> None:
    problem = checks(facts(launcher={"name": "srun", "world_size": 1, "cpus_per_task": 8},
                           torch={"cpus_available": 1, "cpus_owned": 8, "threads": 1}))["cpus-per-task"]
    assert "SRUN_CPUS_PER_TASK" in problem["fix"]


def test_gpus_given_but_torch_cannot_use_them() -> None:
    cpu_torch = checks(facts(gpus={"cuda_visible_devices": "0"}))["torch-cuda"]
    assert "CUDA_VISIBLE_DEVICES=0" in cpu_torch["message"] and "CPU-only build" in cpu_torch["message"]
    assert "--index-url https://download.pytorch.org/whl/cu129" in cpu_torch["fix"]
    no_driver = checks(facts(gpus={"cuda_visible_devices": "0"}, torch={"cuda": "12.9"}))["gpu-visible"]
    assert "apptainer exec --nv" in no_driver["fix"]
    assert problems(facts(gpus={"cuda_visible_devices": "NoDevFiles"})) == []


def test_too_many_ranks_for_the_gpus() -> None:
    f = facts(gpus={"visible": 2, "device": None, "device_error": "4 ranks on node n1 but only 2 visible GPU(s)"},
              mpi={"cuda_aware": True}, torch={"cuda": "12.9"})
    assert checks(f)["gpu-device"]["message"].startswith("4 ranks on node n1")


def test_mpi_missing_and_bad_hdf5_locking() -> None:
    f = facts()
    f["mpi"] = {"error": "cannot import mpi4py (no libmpi.so.40)"}
    assert "no libmpi.so.40" in checks(f)["mpi"]["message"]
    bad = checks(facts(hdf5={"raw": "yes", "valid": False}))["hdf5-locking"]
    assert bad["message"] == "HDF5 ignores HDF5_USE_FILE_LOCKING='yes': it is not a value HDF5 knows"


@pytest.mark.parametrize(
    "value, mode, valid",
    [(None, "best-effort", True), ("", "best-effort", True), ("FALSE", "off", True), ("0", "off", True),
     ("TRUE", "on", True), ("1", "on", True), ("BEST_EFFORT", "best-effort", True), ("false", "best-effort", False)],
)
def test_file_locking_setting(value: str | None, mode: str, valid: bool) -> None:
    environ = {} if value is None else {"HDF5_USE_FILE_LOCKING": value}
    got = file_locking((True, True), environ)
    assert (got.mode, got.valid) == (mode, valid)
    assert file_locking((False, False), {}).mode == "off"


def test_format_report_shows_cuda_aware_and_fixes() -> None:
    f = facts(**GPU_NODE)
    f["problems"] = problems(f)
    report = {"ok": False, "world_size": 1, "ranks": [f],
              "problems": [{**p, "ranks": [0]} for p in f["problems"]]}
    text = format_report(report)
    assert "CUDA-aware  no: Open MPI v5.0.10 cannot take GPU memory\n" in text
    assert "GPUs        4 visible (CUDA_VISIBLE_DEVICES=0,1,2,3); rank 0 uses cuda:0" in text
    assert "  [cuda-aware] rank 0: 4 GPU(s) visible" in text and "      fix: run in the hpctrain image" in text


# -- on this machine ------------------------------------------------------------------------------------------


def _ompi_built_with_cuda() -> bool | None:
    ompi_info = shutil.which("ompi_info")
    if ompi_info is None:
        return None
    out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True).stdout
    match = re.search(r"mpi_built_with_cuda_support:value:(\w+)", out)
    return None if match is None else match.group(1) == "true"


def _clean_env(**extra: str) -> dict[str, str]:
    env = mpi_env(**extra)
    for name in ("CUDA_VISIBLE_DEVICES", "HDF5_USE_FILE_LOCKING", "OMP_NUM_THREADS", "SLURM_JOB_ID",
                 "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_CPUS_PER_TASK", "SLURM_PROCID"):
        if name not in extra:
            env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def machine_report() -> dict[str, Any]:
    proc = hpctrain(["doctor", "--json", "--strict"], env=_clean_env(), timeout=120)
    return json.loads(proc.stdout)


def test_doctor_reports_this_machines_open_mpi_as_not_cuda_aware(machine_report: dict[str, Any]) -> None:
    built = _ompi_built_with_cuda()
    if built is None:
        pytest.skip("no ompi_info here: install openmpi-bin (make test installs it)")
    assert built is False, "this test expects Debian's Open MPI, which is built without CUDA"
    rank = machine_report["ranks"][0]
    assert rank["mpi"]["cuda_aware"] is False
    assert rank["mpi"]["library"].startswith("Open MPI v")
    assert rank["mpi"]["thread_level"] == "multiple"
    assert rank["mpi"]["world_size"] == 1 and rank["launcher"]["name"] == "none"
    assert rank["gpus"]["visible"] == 0 and rank["gpus"]["device"] == "cpu"
    assert machine_report["ok"] is True and machine_report["problems"] == []
    assert rank["hdf5"]["hdf5"] and rank["hdf5"]["valid"] is True
    assert rank["torch"]["cpus_available"] == len(os.sched_getaffinity(0))


def test_doctor_text_says_not_cuda_aware() -> None:
    proc = hpctrain(["doctor"], env=_clean_env(), timeout=120)
    assert re.search(r"^  CUDA-aware  no: Open MPI v\d+\.\d+\.\d+ cannot take GPU memory "
                     r"\(not needed here: no GPU visible\)$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^  MPI         Open MPI v[\d.]+ \(MPI [\d.]+\), mpi4py [\d.]+, thread level multiple, "
                     r"world of 1$", proc.stdout, re.M)
    assert proc.stdout.rstrip().endswith("no problems found")


def test_strict_exits_1_on_a_real_problem() -> None:
    """Two real misconfigurations of this machine: a GPU assigned to a CPU-only torch, and a bad HDF5 setting."""
    env = _clean_env(CUDA_VISIBLE_DEVICES="0", HDF5_USE_FILE_LOCKING="yes")
    proc = hpctrain(["doctor", "--json", "--strict"], env=env, check=False, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    torch_cuda = report["ranks"][0]["torch"]["cuda"]
    expected = {"hdf5-locking"} | ({"torch-cuda"} if torch_cuda is None else {"gpu-visible"})
    assert report["ok"] is False and {p["check"] for p in report["problems"]} == expected
    assert all(p["fix"] and p["ranks"] == [0] for p in report["problems"])
    text = format_report(report)
    assert set(re.findall(r"^  \[([\w-]+)\] rank 0: ", text, re.M)) == expected
