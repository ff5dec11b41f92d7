"""The examples in examples/ run under mpirun -n 2 as the README says, through the public API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from conftest import ROOT, hpctrain, mpi_checks, mpirun, summary

pytestmark = pytest.mark.mpi
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).parent / "scripts"


def test_seed_template_converted(tmp_path: Path) -> None:
    proc = mpirun(2, [str(EXAMPLES / "seed_template.py"), "--epochs", "3"], python_module=False, cwd=tmp_path)
    losses = [float(v) for v in re.findall(r"epoch \d+ loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.9, losses
    assert proc.stdout.count("in_sync True") == 2
    assert (tmp_path / "model_epoch2.pth").exists()


def run_loop(data: Path, run: Path, epochs: int, said: list[str] | None = None, extra: tuple[str, ...] = ()) -> dict:
    proc = mpirun(2, [str(EXAMPLES / "custom_loop.py"), "--data", str(data), "--run-dir", str(run), "--epochs",
                      str(epochs), *extra], python_module=False)
    if said is not None:
        said.append(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_custom_loop_with_accumulation_resumes_exactly(digits2: Path, tmp_path: Path) -> None:
    said: list[str] = []
    straight = run_loop(digits2, tmp_path / "a", 4, said, extra=("--trace", "30:49"))  # the library's Timeline too
    assert straight["in_sync"] and straight["step"] == 4 * 23
    assert "straggler: " in said[0] and (tmp_path / "a" / "trace.json").is_file(), said[0]
    trace = json.loads((tmp_path / "a" / "trace.json").read_text())
    spans = {(e["name"], e["args"]["step"]) for e in trace["traceEvents"] if e.get("cat") == "phase"}
    assert {("forward", 30), ("backward", 49), ("wait", 40), ("optimizer", 40)} <= spans
    said.clear()
    first = run_loop(digits2, tmp_path / "b", 2)
    assert first["step"] == 2 * 23
    resumed = run_loop(digits2, tmp_path / "b", 4, said)
    assert resumed["step"] == straight["step"]
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert said[0].count(f"resumed from step {2 * 23} (") == 1, said[0]  # rank 0 says so, once
    again = run_loop(digits2, tmp_path / "b", 4, said)  # the same command once more: nothing is left
    assert again["step"] == straight["step"] and "nothing left to do" in said[1], said[1]


def test_custom_model_file_through_train(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--model",
               f"{EXAMPLES / 'custom_model.py'}:build", "--epochs", "8", "--optimizer", "adam", "--lr", "0.003"])
    s = summary(run)
    assert s["ranks_in_sync"] and s["val_accuracy"] >= 0.9, s


def test_import_is_cheap() -> None:
    code = "import sys, hpctrain; hpctrain.__dir__(); print('torch' in sys.modules, 'mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.fixture(scope="module")
def api_checks() -> Callable[[int], subprocess.CompletedProcess]:
    """Both API check scripts of one world size in one launch (`mpi_checks`), made when a test first asks."""
    runs: dict[int, subprocess.CompletedProcess] = {}

    def at(n: int) -> subprocess.CompletedProcess:
        if n not in runs:
            runs[n] = mpi_checks(n, [[SCRIPTS / "api_check.py"], [SCRIPTS / "api_mean_check.py"]], timeout=600)
        return runs[n]

    return at


@pytest.mark.parametrize("n", [1, 2, 3])
def test_distributed_optimizer_gives_the_mean_gradient(api_checks, n: int) -> None:
    proc = api_checks(n)
    assert f"API OK {n}" in proc.stdout and proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_fused_optimizer_divides_the_sum_in_its_kernel_and_grad_holds_the_mean(api_checks, n: int) -> None:
    """SGD with momentum and weight decay, Adam, AdamW, fused and not, at every ZeRO stage: three steps each against
    the same optimizer stepped on the mean of every rank's gradient, `.grad` the mean after step() and after
    synchronize()."""
    proc = api_checks(n)
    assert f"API MEAN OK {n}" in proc.stdout and proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("order", ["zero-first", "zero-last"])
def test_uneven_last_batch_gets_its_own_weights_in_either_zeroing_order(tmp_path: Path, order: str) -> None:
    """39 samples in 4 shards: on 2 ranks 19 and 20 samples, so the last step has 3 and 4. Before the fix,
    `step(); zero_grad()` gave each step the weights of the step before it."""
    data = tmp_path / "d"
    hpctrain(["shard", "synthetic:39:5:3", str(data), "--shards", "4", "--val-fraction", "0"])
    proc = mpirun(2, [str(Path(__file__).parent / "scripts" / "api_uneven_check.py"), str(data), order],
                  python_module=False, timeout=120)
    assert f"UNEVEN OK 2 {order} 5" in proc.stdout


def test_the_language_model_example_shards_trains_and_generates(tmp_path: Path) -> None:
    """examples/language_model.sh as the README runs it (fewer steps): text -> shards -> GPT -> text."""
    import os

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OUT=str(tmp_path / "lm"),
               STEPS="40", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", str(EXAMPLES / "language_model.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"val [\d.]+ bits per byte, \d+ tokens/s, MFU [\d.]+", proc.stdout), proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("def ") or "\ndef " in proc.stdout
    assert summary(tmp_path / "lm" / "run")["ranks_in_sync"]
