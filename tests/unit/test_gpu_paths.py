"""benchmarks/gpu_paths.py, the driver of benchmarks/gpu_check.sh: how it turns every rank's outcome into one
verdict, chooses paths and counts, and the shell script's hygiene. (The driver itself runs on the CPU in
tests/mpi/test_gpu_paths_mpi.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_paths  # noqa: E402

NAMES = ["allreduce-blocking", "allreduce-fp16", "zero2-reduce-scatter", "zero2-allreduce", "topk", "resume-topk"]


def test_a_failure_on_any_rank_fails_the_path_and_names_that_rank() -> None:
    line = gpu_paths.combine("zero2-allreduce/staged", [("PASS", "fine"), ("FAIL", "AssertionError: drift")], 1.0)
    assert line == "FAIL zero2-allreduce/staged: rank 1: AssertionError: drift"
    assert gpu_paths.tally([line]) == (0, 1, 0)


def test_ranks_that_disagree_on_skipping_fail_and_agreeing_ones_pass_or_skip() -> None:
    assert gpu_paths.combine("topk/cuda-aware", [("SKIP", "not CUDA-aware"), ("PASS", "ok")], 0.5).startswith(
        "FAIL topk/cuda-aware: the ranks disagree")
    assert gpu_paths.combine("topk/cuda-aware", [("SKIP", "not CUDA-aware")] * 2, 0.0) == \
        "SKIP topk/cuda-aware: not CUDA-aware"
    assert gpu_paths.combine("topk/staged", [("PASS", "rank 0 says"), ("PASS", "rank 1 says")], 2.25) == \
        "PASS topk/staged (rank 0 says; 2.2 s)"


def test_tally_counts_each_kind_of_verdict() -> None:
    lines = ["PASS a/staged (x)", "SKIP a/cuda-aware: y", "FAIL b/staged: z", "PASS c/cuda (w)"]
    assert gpu_paths.tally(lines) == (2, 1, 1)


def test_a_selector_is_a_name_or_the_prefix_before_a_dash_in_catalogue_order() -> None:
    assert gpu_paths.select(["topk", "zero2"], NAMES) == ["zero2-reduce-scatter", "zero2-allreduce", "topk"]
    assert gpu_paths.select([], NAMES) == NAMES
    assert gpu_paths.select(["resume"], NAMES) == ["resume-topk"]  # `topk` alone is not resume-topk
    with pytest.raises(ValueError, match=r"unknown path 'zero'.*allreduce-blocking, allreduce-fp16"):
        gpu_paths.select(["zero"], NAMES)  # a prefix stops at a dash: zero2 selects, zero does not


def test_gpu_check_sh_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed: apt-get install shellcheck (make test installs it)")
    proc = subprocess.run([shellcheck, str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_a_verdict_line_names_its_item_whatever_its_kind() -> None:
    """The driver starts the worker again for the items without a verdict: each kind of line must name its item."""
    assert gpu_paths.verdict_item("PASS zero2-allreduce/staged (4 steps; 0.1 s)") == "zero2-allreduce/staged"
    assert gpu_paths.verdict_item("FAIL resume-topk/staged: rank 1: RuntimeError: x") == "resume-topk/staged"
    assert gpu_paths.verdict_item("SKIP topk/cuda-aware: the MPI is not CUDA-aware") == "topk/cuda-aware"
    assert gpu_paths.verdict_item("INFO torch 2.11.0, 2 ranks on cuda:0") is None
    assert gpu_paths.verdict_item("START topk/staged") is None
