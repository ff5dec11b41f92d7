"""The suite's warm ranks (tests/startup/warmranks.py) behave as the fresh processes they stand for: the same
arguments, environment, working directory, streams, thread count and exit, and a copy never outlives the process
mpirun started. Every MPI test relies on this, so it is checked here against real cold ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import warmranks

from conftest import PYTHON, mpi_env, mpirun
from hpctrain.base.stop import block_prefix
from hpctrain.tools.launch import children_states

pytestmark = pytest.mark.mpi

SELF = """
import json, os, sys
from mpi4py import MPI
import torch
comm = MPI.COMM_WORLD
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
print(json.dumps({"rank": comm.rank, "sum": comm.allreduce(comm.rank), "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "probe": os.environ.get("PROBE"), "umask": os.umask(0o22),
                  "threads": torch.get_num_threads(), "stdin": sys.stdin.read(), "name": __name__,
                  "file": __file__, "warm": any(b"warmranks.py" in part for part in parent)}), flush=True)
sys.exit(3 if comm.rank == 1 else 0)
"""

FOREVER = """
import os, signal, sys, time
from mpi4py import MPI
def ended(signum, frame):
    print("stopped by", signal.Signals(signum).name, flush=True)
    sys.exit(5)
signal.signal(signal.SIGTERM, ended)
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ended_after(proc: subprocess.Popen, act: Callable[[], None]) -> tuple[str, str]:
    """Does `act` to a running job and waits for its end; a job still running after a failure is killed."""
    try:
        act()
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_forever(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, list[int]]:
    """FOREVER on 2 ranks; returns the job and the pids its programs report."""
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    proc = subprocess.Popen(["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", PYTHON, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, [int(proc.stdout.readline().split()[1]) for _ in range(2)]


def cold_env(**extra: str) -> dict[str, str]:
    env = mpi_env(**extra)
    env.pop("HPCTRAIN_WARM_RANKS", None)
    return env


def run_self(tmp_path: Path, env: dict[str, str]) -> tuple[int, list[dict]]:
    script = tmp_path / "self.py"
    script.write_text(SELF)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    proc = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", PYTHON, str(script), "a b",
                           "--x"], capture_output=True, text=True, timeout=120, env=env, cwd=work, input="")
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda row: row["rank"])
    return proc.returncode, rows


def test_a_warm_rank_runs_its_program_as_a_fresh_process_would(tmp_path: Path) -> None:
    assert os.environ.get("HPCTRAIN_WARM_RANKS"), "this worker has no warm-rank server"
    warm_code, warm = run_self(tmp_path, mpi_env(PROBE="p1"))
    cold_code, cold = run_self(tmp_path, cold_env(PROBE="p1"))
    assert [row.pop("warm") for row in warm] == [True, True], warm
    assert [row.pop("warm") for row in cold] == [False, False], cold
    assert warm == cold and len(warm) == 2, (warm, cold)
    assert warm[0]["argv"][1:] == ["a b", "--x"] and warm[0]["probe"] == "p1" and warm[0]["sum"] == 1
    assert warm_code == cold_code != 0


def test_a_warm_rank_runs_a_module_too() -> None:
    proc = mpirun(1, ["--version"])
    assert proc.stdout.startswith("hpctrain ")


@pytest.mark.parametrize("env", [mpi_env, cold_env], ids=["warm", "cold"])
def test_a_signal_to_mpirun_reaches_the_program_and_its_exit_comes_back(tmp_path: Path,
                                                                        env: Callable[..., dict[str, str]]) -> None:
    proc, pids = start_forever(tmp_path, env())
    out, err = ended_after(proc, lambda: os.kill(proc.pid, signal.SIGTERM))
    assert out.count("stopped by SIGTERM") == 2, (out, err)
    assert proc.returncode != 0
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)]


def test_a_warm_copy_dies_with_the_process_mpirun_started(tmp_path: Path) -> None:
    """... and `copy_of` names it behind its stand-in (the chaos judge reads the copy's signal state there)."""
    proc, copies = start_forever(tmp_path, mpi_env())
    stand_ins = list(children_states(proc.pid))
    assert len(stand_ins) == 2 and not set(stand_ins) & set(copies), (stand_ins, copies)
    assert sorted(map(warmranks.copy_of, stand_ins)) == sorted(copies), (stand_ins, copies)
    ended_after(proc, lambda: os.kill(stand_ins[1], signal.SIGKILL))
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while any(map(alive, copies)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in copies if alive(p)]


def test_hpctrain_train_alone_runs_warm_and_ends_as_it_does_cold(digits2: Path, tmp_path: Path) -> None:
    """`hpctrain train` with no launcher (an MPI singleton) hands over too: the same threads and parameters."""
    ends = {}
    for name, env in (("warm", mpi_env()), ("cold", cold_env())):
        run = tmp_path / name
        proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "train", "--data", str(digits2), "--run-dir", str(run),
                                 "--max-steps", "6"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        stand_in = proc.pid
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        pid = int(re.search(r"pid (\d+)", (run / "logs" / "rank-0000.log").read_text()).group(1))
        assert (pid != stand_in) == (name == "warm"), (name, pid, stand_in)
        summary = json.loads((run / "summary.json").read_text())
        ends[name] = (summary["param_sha256"], summary.get("threads"))
    assert ends["warm"] == ends["cold"], ends


@pytest.mark.parametrize("env", [mpi_env, cold_env], ids=["warm", "cold"])
def test_a_signal_ignored_at_start_still_reaches_a_program_that_takes_it_later(
        digits2: Path, tmp_path: Path, env: Callable[..., dict[str, str]]) -> None:
    """A pytest-xdist worker ignores SIGINT, and so does every process it starts until the program takes it
    (the trainer does): Ctrl-C to `hpctrain train` alone then stops it at a step, warm or cold."""
    run = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "train", "--data", str(digits2), "--run-dir", str(run),
                             "--model", "mlp:64", "--batch-size", "8", "--max-steps", "400", "--log-every", "1"],
                            env=env(HPCTRAIN_TEST_STRAGGLER="0:0.03"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    _, err = ended_after(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert proc.returncode == 3 and "stopped by SIGINT at step" in err, (proc.returncode, err[-2000:])


@pytest.mark.parametrize("code", ["raise ValueError('boom')", "import sys; sys.exit('bad input')"])
def test_a_warm_rank_ends_with_what_a_fresh_one_prints_and_returns(tmp_path: Path, code: str) -> None:
    """An uncaught exception (its traceback, from the program on) or `sys.exit(message)` ends a copy as it
    ends a fresh interpreter: the same stderr from the rank, the same exit code."""
    script = tmp_path / "end.py"
    script.write_text(f"from mpi4py import MPI\n{code}\n")
    ends = []
    for env in (mpi_env(), cold_env()):
        proc = subprocess.run(["mpirun", "-n", "1", PYTHON, str(script)], capture_output=True, text=True,
                              timeout=120, env=env)
        said = proc.stderr.split("-" * 74)[0]  # the rank's own lines, before mpirun's report
        ends.append((proc.returncode, said))
    assert ends[0] == ends[1] and ends[0][0] != 0 and ends[0][1].strip(), ends



HELD = """
import signal, sys, time
def ended(signum, frame):
    print("stopped by", signal.Signals(signum).name, flush=True)
    sys.exit(0)  # the other ranks go on: mpirun would end them at a non-zero exit
signal.signal(signal.SIGTERM, ended)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
time.sleep(60)
"""


def test_a_signal_held_at_the_rank_s_start_waits_in_its_copy(tmp_path: Path) -> None:
    """Ranks started with their stop signals blocked (behind `hpctrain launch`'s prefix) keep a SIGTERM sent the
    moment their copy exists until the program takes it, as fresh ones do: the copy is forked with them blocked.
    Before, one that the stand-in passed on before the copy took the rank's mask ended it by the server's default
    action (a chaos case: SIGTERM to a rank 0.4 s into its start-up, exit 143 instead of 3)."""
    script = tmp_path / "held.py"
    script.write_text(HELD)
    for _ in range(3):
        proc = subprocess.Popen(["mpirun", "-n", "4", "--oversubscribe", "--bind-to", "none", *block_prefix(), PYTHON,
                                 str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env())

        def stop_each_as_its_copy_appears() -> None:
            sent: set[int] = set()
            deadline = time.monotonic() + 60
            while len(sent) < 4 and time.monotonic() < deadline:
                for pid in children_states(proc.pid):
                    if pid not in sent and warmranks.copy_of(pid):
                        os.kill(pid, signal.SIGTERM)
                        sent.add(pid)
                time.sleep(0.0005)
            assert len(sent) == 4, sent

        out, err = ended_after(proc, stop_each_as_its_copy_appears)
        assert proc.returncode == 0 and out.count("stopped by SIGTERM") == 4, (proc.returncode, out, err)
