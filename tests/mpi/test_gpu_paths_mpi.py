"""benchmarks/gpu_paths.py (what benchmarks/gpu_check.sh runs on a GPU machine) run for real with --device cpu
under mpirun: the same paths, on the CPU, so that the GPU check cannot rot where no GPU is at hand."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, mpi_env

DRIVER = ROOT / "benchmarks" / "gpu_paths.py"


def drive(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(DRIVER), "--device", "cpu", "--work", str(tmp_path), *args], cwd=ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=timeout)


def verdicts(stdout: str) -> dict[str, str]:
    """item -> PASS, FAIL or SKIP."""
    return {line.split()[1]: line.split()[0] for line in stdout.splitlines() if line.startswith(("PASS ", "FAIL ", "SKIP "))}


@pytest.mark.mpi
def test_zero2_topk_and_the_fp16_scaler_pass_on_the_cpu(tmp_path: Path) -> None:
    proc = drive(tmp_path, "--paths", "zero2,topk,fp16-scaler")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(proc.stdout) == {f"{name}/cpu": "PASS" for name in (
        "zero2-reduce-scatter-block", "zero2-reduce-scatter", "zero2-allreduce", "zero2-ring", "topk",
        "fp16-scaler")}, proc.stdout
    assert proc.stdout.splitlines()[-1] == "6 passed, 0 failed, 0 skipped"


@pytest.mark.mpi
def test_an_unknown_path_is_bad_input_that_names_the_valid_ones(tmp_path: Path) -> None:
    proc = drive(tmp_path, "--paths", "zero2,nosuch", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown path 'nosuch'" in proc.stdout and "zero2-allreduce" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_every_path_but_the_reference_benchmark_passes_on_the_cpu(tmp_path: Path) -> None:
    listed = subprocess.run([PYTHON, str(DRIVER), "--list"], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                            timeout=120)
    names = [n for n in listed.stdout.split() if not n.startswith("bench-")]  # bench: tests/unit/test_bench.py
    assert {"allreduce-accumulate", "zero1-allreduce", "zero3-reduce-scatter", "powersgd", "fused-adamw", "mfu-peak",
            "resume-fp16", "resume-zero3-fp16", "train-cli"} <= set(names), listed.stdout
    proc = drive(tmp_path, "--paths", ",".join(names), timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(proc.stdout) == {f"{name}/cpu": "PASS" for name in names}, proc.stdout
