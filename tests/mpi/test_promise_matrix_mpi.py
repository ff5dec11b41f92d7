"""The promise matrix of #54: every promise on every way a user enters a run.

Entries: `hpctrain launch`, a bare `mpirun ... python -m hpctrain train`, `hpctrain train` alone (one process,
no launcher), a library-API script (examples/custom_loop.py and the loop of the library guide), an
`hpctrain.horovod` script, and `srun` on the local Slurm cluster. Promises: a stop signal (SIGINT, SIGTERM,
SIGUSR2) checkpoints and exits 3; a resume from a periodic checkpoint ends bit-identical to the uninterrupted
run; a resume on another world size trains the same epochs and samples; a resume states what changed on its
first line.

CELLS names the test of each pair. The pairs that other files already assert point there (a second copy of a
test is where the next drift hides); the rest are here, and the srun row is in tests/slurm/, where the local
cluster runs. Where a pair cannot hold, its test asserts what the user gets and says why: the Horovod API has
no checkpointer of hpctrain's, so a Horovod script keeps what its last `hvd.elastic` commit kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, ROOT, mpi_env, summary
from hpctrain.checkpoint import manager as ckpt
from test_stop_signals_mpi import start, stopped_and_recorded, wait_for_step

pytestmark = pytest.mark.mpi
HERE = Path(__file__).parent
HVD = HERE / "scripts" / "promise_hvd.py"
LOOP = ROOT / "examples" / "custom_loop.py"
ENTRIES = ("launch", "mpirun", "alone", "library", "horovod", "srun")
PROMISES = ("SIGINT", "SIGTERM", "SIGUSR2", "exact", "elastic", "first-line")

_STOPS = "tests/mpi/test_stop_signals_mpi.py::"
_RESUME = "tests/mpi/test_resume_paths_mpi.py::"
_HERE = "tests/mpi/test_promise_matrix_mpi.py::"
_SLURM = "tests/slurm/test_promise_matrix_slurm.py::"
CELLS = {
    ("launch", "SIGINT"): _STOPS + "test_a_stop_to_hpctrain_launch_is_recorded_as_who_asked",
    ("launch", "SIGTERM"): _STOPS + "test_a_stop_to_hpctrain_launch_is_recorded_as_who_asked",
    ("launch", "SIGUSR2"): _HERE + "test_a_stop_signal_checkpoints_and_exits_3",
    ("launch", "exact"): _HERE + "test_a_resume_from_a_periodic_checkpoint_ends_bit_identical",
    ("launch", "elastic"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    ("launch", "first-line"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    # SIGINT and SIGTERM to mpirun itself are Open MPI's abort (exit 1, an xfail there): sent to the ranks, as
    # Slurm and a scheduler send them, they checkpoint and exit 3
    ("mpirun", "SIGINT"): _STOPS + "test_a_signal_to_every_rank_of_a_bare_mpirun_checkpoints_and_exits_3",
    ("mpirun", "SIGTERM"): _STOPS + "test_a_signal_to_every_rank_of_a_bare_mpirun_checkpoints_and_exits_3",
    ("mpirun", "SIGUSR2"): _STOPS + "test_sigusr2_to_a_bare_mpirun_checkpoints_and_exits_3",
    ("mpirun", "exact"): _HERE + "test_a_resume_from_a_periodic_checkpoint_ends_bit_identical",
    ("mpirun", "elastic"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    ("mpirun", "first-line"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    ("alone", "SIGINT"): _STOPS + "test_ctrl_c_to_train_alone_checkpoints_exits_3_and_resumes",
    ("alone", "SIGTERM"): _HERE + "test_a_stop_signal_checkpoints_and_exits_3",
    ("alone", "SIGUSR2"): _HERE + "test_a_stop_signal_checkpoints_and_exits_3",
    ("alone", "exact"): _HERE + "test_a_resume_from_a_periodic_checkpoint_ends_bit_identical",
    ("alone", "elastic"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    ("alone", "first-line"): _HERE + "test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so",
    ("library", "SIGINT"): _STOPS + "test_ctrl_c_to_the_library_example_checkpoints_exits_3_and_says_who_asked",
    ("library", "SIGTERM"): _HERE + "test_a_stop_signal_to_the_library_example_checkpoints_and_exits_3",
    ("library", "SIGUSR2"): _HERE + "test_a_stop_signal_to_the_library_example_checkpoints_and_exits_3",
    ("library", "exact"): _RESUME + "test_custom_loop_resumed_from_a_periodic_checkpoint_ends_bit_identical",
    ("library", "elastic"): _RESUME + "test_the_library_loop_resumed_on_another_world_size_keeps_the_epoch",
    ("library", "first-line"): _RESUME + "test_the_library_loop_resumed_on_another_world_size_keeps_the_epoch",
    ("horovod", "SIGINT"): _HERE + "test_a_stop_signal_ends_a_horovod_script_which_keeps_its_last_commit",
    ("horovod", "SIGTERM"): _HERE + "test_a_stop_signal_ends_a_horovod_script_which_keeps_its_last_commit",
    ("horovod", "SIGUSR2"): _HERE + "test_a_stop_signal_ends_a_horovod_script_which_keeps_its_last_commit",
    ("horovod", "exact"): _HERE + "test_a_stop_signal_ends_a_horovod_script_which_keeps_its_last_commit",
    ("horovod", "elastic"): _HERE + "test_a_horovod_commit_resumes_on_another_world_size_and_nothing_is_stated",
    ("horovod", "first-line"): _HERE + "test_a_horovod_commit_resumes_on_another_world_size_and_nothing_is_stated",
    ("srun", "SIGINT"): _SLURM + "test_scancel_signal_to_the_tasks_of_srun_checkpoints_and_exits_3",
    ("srun", "SIGTERM"): _SLURM + "test_scancel_signal_to_the_tasks_of_srun_checkpoints_and_exits_3",
    ("srun", "SIGUSR2"): _SLURM + "test_scancel_signal_to_the_tasks_of_srun_checkpoints_and_exits_3",
    ("srun", "exact"): _SLURM + "test_srun_resumed_from_a_periodic_checkpoint_ends_bit_identical",
    ("srun", "elastic"): _SLURM + "test_srun_on_another_world_size_trains_each_sample_once_and_says_so",
    ("srun", "first-line"): _SLURM + "test_srun_on_another_world_size_trains_each_sample_once_and_says_so",
}


def test_every_cell_of_the_matrix_names_a_test_that_exists() -> None:
    assert set(CELLS) == {(e, p) for e in ENTRIES for p in PROMISES}
    for cell, node in CELLS.items():
        path, name = node.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (cell, node)


def train_argv(entry: str, n: int, data: Path, run: Path, *args: str) -> list[str]:
    """`hpctrain train` on n ranks, entered as `entry` does."""
    head = {"launch": [PYTHON, "-m", "hpctrain", "launch", "-n", str(n), "--"],
            "mpirun": ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", PYTHON, "-m", "hpctrain"],
            "alone": [PYTHON, "-m", "hpctrain"]}[entry]
    assert entry != "alone" or n == 1, "one process without a launcher is one rank"
    return [*head, "train", "--data", str(data), "--run-dir", str(run), *args]


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or mpi_env())
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


STOP_ARGS = ["--model", "mlp:64", "--batch-size", "8", "--max-steps", "150", "--log-every", "1", "--seed", "3"]


@pytest.mark.parametrize("entry,sig", [("alone", signal.SIGTERM), ("alone", signal.SIGUSR2),
                                       ("launch", signal.SIGUSR2)],
                         ids=["alone-SIGTERM", "alone-SIGUSR2", "launch-SIGUSR2"])
def test_a_stop_signal_checkpoints_and_exits_3(digits2: Path, tmp_path: Path, entry: str, sig: signal.Signals) -> None:
    """The scheduler's signals to the one process a user started: `hpctrain train` itself, or the launcher
    (which forwards SIGUSR2 to mpirun, and mpirun to every rank)."""
    rundir = tmp_path / "run"
    proc = start(train_argv(entry, 1 if entry == "alone" else 2, digits2, rundir, *STOP_ARGS))
    wait_for_step(rundir, proc)
    os.kill(proc.pid, sig)
    stopped_and_recorded(proc, rundir, sig.name, "scheduler")


@pytest.mark.parametrize("n,sig", [(1, signal.SIGTERM), (2, signal.SIGUSR2)], ids=["alone-SIGTERM", "mpirun-SIGUSR2"])
def test_a_stop_signal_to_the_library_example_checkpoints_and_exits_3(digits2: Path, tmp_path: Path, n: int,
                                                                     sig: signal.Signals) -> None:
    """`Checkpointer.step` turns a scheduler's stop into a checkpoint and True; the example then exits 3. One
    process gets the signal itself; under mpirun, mpirun forwards SIGUSR2 to every rank."""
    rundir = tmp_path / "run"
    head = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none"] if n > 1 else []
    proc = start([*head, PYTHON, str(LOOP), "--data", str(digits2), "--run-dir", str(rundir), "--epochs", "300"])
    deadline = time.time() + 180
    while ckpt.latest(rundir) is None and proc.poll() is None and time.time() < deadline:  # step 50's, every=50
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (proc.returncode, err)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stopped"] and result["asked_by"] == "scheduler" and result["in_sync"], result
    record = json.loads((rundir / "stopped.json").read_text())
    assert record == {**record, "step": result["step"], "signal": sig.name, "asked_by": "scheduler"}
    assert ckpt.verify(ckpt.latest(rundir))["step"] == result["step"] > 50


EXACT_ARGS = ["--model", "mlp:64", "--batch-size", "8", "--max-steps", "12", "--checkpoint-every", "5",
              "--seed", "3"]


@pytest.mark.parametrize("entry,n", [("launch", 2), ("mpirun", 2), ("alone", 1)])
def test_a_resume_from_a_periodic_checkpoint_ends_bit_identical(digits2: Path, tmp_path: Path, entry: str,
                                                               n: int) -> None:
    """The uninterrupted run keeps its periodic checkpoint of step 10 beside its last; without the last, the
    same command resumes from step 10 and ends on the same parameters, bit for bit."""
    rundir = tmp_path / "run"
    argv = train_argv(entry, n, digits2, rundir, *EXACT_ARGS)
    run(argv)
    straight = summary(rundir)
    assert straight["steps"] == 12 and straight["world_size"] == n, straight
    shutil.rmtree(rundir / "checkpoints" / "step-0000012")
    proc = run(argv)
    assert proc.stderr.splitlines()[0].startswith("resumed from step 10 ("), proc.stderr
    resumed = summary(rundir)
    assert (resumed["resumed_from"], resumed["steps"]) == (10, 12), resumed
    assert resumed["param_sha256"] == straight["param_sha256"]


@pytest.fixture(scope="module")
def cut(digits2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A run of 5 steps (160 samples of the first epoch per rank) on 1 rank and on 2, to be continued elsewhere."""
    runs = {}
    for n, entry in [(1, "alone"), (2, "launch")]:
        runs[n] = tmp_path_factory.mktemp(f"cut{n}") / "run"
        run(train_argv(entry, n, digits2, runs[n], "--max-steps", "5", "--audit-samples"))
    return runs


@pytest.mark.parametrize("entry,n,was", [("alone", 1, 2), ("launch", 2, 1), ("mpirun", 1, 2)])
def test_a_resume_on_another_world_size_trains_each_sample_once_and_says_so(
        digits2: Path, tmp_path: Path, cut: dict[int, Path], entry: str, n: int, was: int) -> None:
    """Continued mid-epoch on another world size, with a changed learning rate: the first line names the world
    size, the global batch and the setting; the epoch ends having trained each of its samples once, and the
    run counts one epoch."""
    rundir = tmp_path / "run"
    shutil.copytree(cut[was], rundir)
    proc = run(train_argv(entry, n, digits2, rundir, "--epochs", "1", "--lr", "0.02", "--audit-samples"))
    first = proc.stderr.splitlines()[0]
    assert first.startswith("resumed from step 5 ("), proc.stderr
    for change in (f"world size {was} -> {n}", f"global batch {32 * was} -> {32 * n}", "lr: 0.05 -> 0.02"):
        assert change in first, (change, first)
    ids = [line.split()[1] for f in sorted((rundir / "samples").glob("rank-*.txt"))
           for line in f.read_text().splitlines() if line.split()[0] == "0"]
    n_train = json.loads((digits2 / "manifest.json").read_text())["splits"]["train"]["samples"]
    assert len(ids) == n_train and len(set(ids)) == n_train, (len(ids), len(set(ids)), n_train)
    assert (summary(rundir)["epochs"], summary(rundir)["world_size"]) == (1, n), summary(rundir)


def hvd_argv(n: int, *args: str) -> list[str]:
    return ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", PYTHON, str(HVD), *args]


def hvd_env(elastic: Path) -> dict[str, str]:
    return mpi_env(HPCTRAIN_ELASTIC_DIR=str(elastic))


def committed_step(elastic: Path) -> int:
    return int(torch.load(elastic / "elastic_state.pt", weights_only=True)["values"]["step"])


@pytest.fixture(scope="module")
def hvd_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The Horovod script's 40 steps on 2 ranks, uninterrupted."""
    elastic = tmp_path_factory.mktemp("hvd_ref")
    return json.loads(run(hvd_argv(2, "40", "5"), hvd_env(elastic)).stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR2], ids=lambda s: s.name)
def test_a_stop_signal_ends_a_horovod_script_which_keeps_its_last_commit(tmp_path: Path, hvd_reference: dict,
                                                                        sig: signal.Signals) -> None:
    """What a Horovod script gets, as under Horovod: hpctrain.horovod installs no stop handler (the script owns
    its loop, and there is no Checkpointer in it to save), so the signal's default action ends the ranks
    (SIGINT: KeyboardInterrupt) and the job exits non-zero, never 3. What survives is the last
    `state.commit()`; the same command resumes there and ends bit-identical to the uninterrupted run."""
    proc = subprocess.Popen(hvd_argv(2, "40", "5", "0.1"), env=hvd_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids, step = [], 0
    for line in proc.stdout:
        if line.startswith("pid "):
            pids.append(int(line.split()[2]))
        elif line.startswith("step "):
            step = int(line.split()[1])
            if step >= 12:
                break
    for pid in pids:  # as Slurm signals every task
        os.kill(pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, 3), (proc.returncode, err)
    kept = committed_step(tmp_path)
    assert 10 <= kept < 40 and kept % 5 == 0, kept
    if sig == signal.SIGTERM:
        resumed = json.loads(run(hvd_argv(2, "40", "5"), hvd_env(tmp_path)).stdout.strip().splitlines()[-1])
        assert (resumed["start"], resumed["step"]) == (kept, 40), resumed
        assert resumed["param_sha256"] == hvd_reference["param_sha256"]


def test_a_horovod_commit_resumes_on_another_world_size_and_nothing_is_stated(tmp_path: Path) -> None:
    """Rank 0's commit of a 2-rank run is broadcast to the ranks of a 1-rank one, which starts at its step.
    hpctrain.horovod keeps no data position and no run configuration: which samples the rest trains on is the
    script's own (here, drawn from the step and the rank), and there is no first line of what changed."""
    run(hvd_argv(2, "10", "5"), hvd_env(tmp_path))
    assert committed_step(tmp_path) == 10
    proc = run(hvd_argv(1, "20", "5"), hvd_env(tmp_path))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["start"], result["step"]) == (10, 20), result
    assert "resumed" not in proc.stdout + proc.stderr and "changed since" not in proc.stderr, proc.stderr
