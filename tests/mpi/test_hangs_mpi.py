"""No run hangs: each case here hung (or failed silently) before its fix; each has a deadline.

Real mpirun, real ranks, real files. Faults are injected inside the rank processes (tests/mpi/scripts)
or by signals from outside, as a scheduler or a failing node would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import h5py
import pytest
import warmranks

from conftest import PYTHON, hpctrain, mpi_env, mpirun, summary

pytestmark = pytest.mark.mpi
# `cold`: a test that stops a rank (SIGSTOP) or signals the ranks it finds in the launcher's process tree runs
# them as fresh processes (tests/startup/warmranks.py)
SCRIPTS = Path(__file__).parent / "scripts"


def test_max_steps_exactly_the_prefetch_depth_before_an_epoch_ends(digits2: Path, tmp_path: Path) -> None:
    """The issue's first report: 23 steps per epoch, --max-steps 21 stopped with 2 batches (the prefetch
    depth) left, and closing the reader joined a thread blocked on a full queue forever."""
    run = tmp_path / "r"
    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(digits2), "--run-dir", str(run), "--batch-size", "32",
              "--max-steps", "21", "--epochs", "3"], timeout=90)
    assert summary(run)["steps"] == 21


def test_random_settings_that_hung(tmp_path: Path) -> None:
    """The issue's second report: digits in 6 shards, batch 50, 14 steps, accumulate 2, no overlap."""
    data, run = tmp_path / "d", tmp_path / "r"
    hpctrain(["shard", "digits", str(data), "--shards", "6"])
    hpctrain(["launch", "-n", "2", "--", "train", "--data", str(data), "--run-dir", str(run), "--batch-size", "50",
              "--max-steps", "14", "--accumulate", "2", "--no-overlap"], timeout=90)
    assert summary(run)["steps"] == 14


def test_allreduce_error_on_one_rank_still_enters_every_bucket() -> None:
    proc = mpirun(2, [str(SCRIPTS / "sync_faults.py"), "error"], python_module=False, timeout=60)
    assert "rank 0 CommError: gradient reduction failed on rank 0" in proc.stdout, proc.stdout
    assert "injected failure after the collective" in proc.stdout, proc.stdout  # the cause is named
    assert "rank 1 done 2" in proc.stdout and "rank 0 CommError" in proc.stdout


def test_second_backward_without_no_sync_raises_instead_of_racing() -> None:
    proc = mpirun(2, [str(SCRIPTS / "sync_faults.py"), "double-backward"], python_module=False, timeout=60)
    assert proc.stdout.count("raised no_sync") == 2, proc.stdout


@pytest.mark.parametrize("n", [1, 2])
def test_broadcast_of_bfloat16_bool_and_strided_tensors(n: int) -> None:
    proc = mpirun(n, [str(SCRIPTS / "sync_faults.py"), "broadcast"], python_module=False, timeout=60)
    assert proc.stdout.count("broadcast ok") == n, proc.stdout


@pytest.mark.parametrize("mode", ["validation", "checkpoint"])
def test_slow_validation_or_checkpoint_write_is_not_a_hang(digits2: Path, tmp_path: Path, mode: str) -> None:
    proc = mpirun(2, [str(SCRIPTS / "slow_phases.py"), str(digits2), str(tmp_path / "r"), mode], python_module=False,
                  timeout=90)
    assert proc.stdout.count("finished") == 2, proc.stdout + proc.stderr


def test_a_rank_failing_alone_ends_the_job_and_says_why(tmp_path: Path) -> None:
    """A corrupt chunk in rank 1's shard fails rank 1 alone, while rank 0 enters the next allreduce: the
    job must end at once with rank 1's message (it used to wait for the collective timeout, silently)."""
    data, run = tmp_path / "d", tmp_path / "r"
    hpctrain(["shard", "synthetic:4000:16:4", str(data), "--shards", "2", "--val-fraction", "0", "--chunk-rows", "64"])
    shard = sorted((data / "train").glob("shard-*.h5"))[1]  # rank 1's
    with h5py.File(shard, "r") as h5:
        offset = h5["x"].id.get_chunk_info(0).byte_offset
    with open(shard, "r+b") as fh:
        fh.seek(offset + 8)
        fh.write(b"\xff" * 16)
    start = time.monotonic()
    proc = mpirun(2, ["train", "--data", str(data), "--run-dir", str(run), "--epochs", "1"], check=False, timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "rank 1: cannot read rows" in proc.stderr and "ending the job" in proc.stderr, proc.stderr


def _rank_pids(launcher: int) -> list[int]:
    """The ranks under `launcher`: the processes with a rank's environment whose parent has none (a rank's
    own child inherits it, and is not a rank)."""
    from hpctrain.tools.launch import descendants

    def is_rank_env(pid: int) -> bool:
        try:
            return b"OMPI_COMM_WORLD_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    return [pid for pid in descendants(launcher) if is_rank_env(pid) and not is_rank_env(parent(pid))]


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return "/env"


def test_stop_signal_ends_a_job_whose_rank_is_stuck(digits2: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher while one rank is stopped (SIGSTOP: stuck, it can never agree to stop): the
    launcher ends the job itself `--grace` seconds later. It used to wait forever."""
    run = tmp_path / "r"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--grace", "3", "--", "train", "--data",
                             str(digits2), "--run-dir", str(run), "--epochs", "500", "--collective-timeout", "0"],
                            env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        for pid in warmranks.with_copy(ranks[1]):  # a warm rank computes in its copy: stuck means both stopped
            os.kill(pid, signal.SIGSTOP)
        ranks = [p for rank in ranks for p in warmranks.with_copy(rank)]  # none of them may be left running
        os.kill(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - signalled < 15
        assert proc.returncode != 0 and "did not stop within 3 s" in err, (proc.returncode, err)
        time.sleep(0.5)
        assert not [p for p in ranks if Path(f"/proc/{p}").exists() and b"Z" not in
                    Path(f"/proc/{p}/stat").read_bytes().split(b") ")[1][:1]], "ranks left running"
    finally:
        if proc.poll() is None:
            from hpctrain.tools.launch import kill_tree
            kill_tree(proc.pid)
            proc.wait()


@pytest.mark.cold
def test_a_rank_stopped_after_the_others_exited_does_not_hold_the_job(tmp_path: Path) -> None:
    """Rank 1 stops itself while rank 0 exits: nothing inside the job can notice any more (its peers are
    gone), and mpirun would wait for it forever. The launcher ends the job `--grace` seconds later."""
    code = ("import os, signal\n"
            "if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n")
    start = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--grace", "2", "--", PYTHON, "-c", code],
                          env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode != 0 and "stopped (SIGSTOP)" in proc.stderr, (proc.returncode, proc.stderr)


def wakeups(pid: int) -> int:
    """Times the main thread of process `pid` has gone to sleep by itself so far (its voluntary switches)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(text.split("voluntary_ctxt_switches:")[1].split()[0])


def test_the_launcher_sleeps_while_its_job_runs_and_still_answers_a_stop_at_once(tmp_path: Path) -> None:
    """The launcher shares the node's cores with the ranks: while the job runs it wakes once a second (its
    look for stopped ranks), where a polling wait woke about 25 times a second. A stop signal still wakes it at
    once, and the job ends as a stopped one (the ranks here are `sleep`, which SIGUSR2 ends)."""
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "1", "--", "sleep", "30"], env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # the launcher is in its loop
        before = wakeups(proc.pid)
        time.sleep(3.0)
        woke = wakeups(proc.pid) - before
        assert woke <= 8, f"the launcher woke {woke} times in 3 s"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 10, err
        assert "hpctrain launch: SIGTERM" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.cold
def test_a_stop_in_a_rank_s_first_milliseconds_is_kept_not_fatal(digits2: Path, tmp_path: Path) -> None:
    """SIGTERM to a rank the moment it exists, while its interpreter starts and long before it could install a
    handler: the rank starts with the stop signals blocked (pending, not lost) and takes them once its handler
    is in, so the job stops at its first step boundary with exit 3. It used to die of the signal (143)."""
    run = tmp_path / "r"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(digits2),
                             "--run-dir", str(run), "--epochs", "500"],
                            env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        ranks: list[int] = []
        while not ranks and time.monotonic() < deadline:  # a rank whose Python has just begun (no longer `env`)
            ranks = [pid for pid in _rank_pids(proc.pid) if not _exe(pid).endswith("/env")]
        assert ranks, "no rank started within 30 s"
        os.kill(ranks[0], signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, (proc.returncode, err[-2000:])
        assert "stopped by SIGTERM during start-up" in err or "stopped by SIGTERM at step" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            from hpctrain.tools.launch import kill_tree
            kill_tree(proc.pid)
            proc.wait()


def test_a_stop_while_the_launcher_starts_ends_the_job_before_it_begins(digits2: Path, tmp_path: Path) -> None:
    """SIGTERM to `hpctrain launch` as soon as it holds the signal (its first lines, before mpirun exists): the
    launcher starts nothing and exits 3. Before, the signal came either before any handler (death by it), or
    just as mpirun started, which then died of the forwarded SIGUSR2 before it could catch it."""
    from hpctrain.tools.launch import catches

    run = tmp_path / "r"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(digits2),
                             "--run-dir", str(run)], env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, (proc.returncode, err[-2000:])
        assert "before the job started" in err and not run.exists(), err
    finally:
        if proc.poll() is None:
            from hpctrain.tools.launch import kill_tree
            kill_tree(proc.pid)
            proc.wait()


def test_a_short_collective_timeout_does_not_abort_a_healthy_start_or_exit(digits2: Path, tmp_path: Path) -> None:
    """`--collective-timeout 1`: the start-up deadline (MPI_Init) used to cover `import torch` too, and the exit
    deadline (MPI_Finalize) a peer's teardown, so on a busy node a healthy job failed (exit 1 or 142; found by the
    soak under load). Both edges now get at least stop.EDGE_FLOOR_S; torch is imported before the deadline."""
    run = tmp_path / "r"
    proc = subprocess.run([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(digits2),
                           "--run-dir", str(run), "--max-steps", "3", "--collective-timeout", "1"],
                          env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert summary(run)["steps"] == 3


def test_a_rank_slower_in_its_own_start_up_or_validation_is_not_a_hang(digits2: Path, tmp_path: Path) -> None:
    """Found under load (a busy node): a start-up collective ("start-up: gradient sync") aborted a healthy job
    with --collective-timeout 1, since only MPI_Init and MPI_Finalize had the edge floor. Rank 1 here takes 3 s
    longer to build its model and to run its first validation pass; the others wait for it in collectives.
    The run's edges (start-up to the first step, validation, the end) get stop.edge_budget; the steady state
    keeps the collective timeout (tests above)."""
    run = tmp_path / "r"
    proc = subprocess.run([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(digits2),
                           "--run-dir", str(run), "--epochs", "2", "--collective-timeout", "1",
                           "--model", f"{SCRIPTS / 'uneven_model.py'}:factory"],
                          env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert summary(run)["steps"] == 2 * 23 and summary(run)["val_accuracy"] is not None


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_bench_whose_rank_is_stuck_ends_instead_of_hanging() -> None:
    """`hpctrain bench` had no watchdog: one whose peer was stuck (its launcher had died) sat for an hour. Rank 1
    is stopped once both ranks are measuring (each has spent 8 s of CPU, start-up 3-4 s of it; a warm rank's
    copy 3 s, its start-up without the torch import under 1 s of it); rank 0's watchdog ends the job
    --collective-timeout seconds later, naming what it was doing."""
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "bench", "train", "-n", "2", "--model", "mlp:64", "--input-dim",
                             "32", "--steps", "1000000", "--rounds", "1", "--baseline", "none", "--collective-timeout",
                             "5"], env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        ranks: list[int] = []
        while time.monotonic() < deadline:
            pids = _rank_pids(proc.pid)
            copies = [warmranks.copy_of(p) for p in pids]
            ranks = [c or p for c, p in zip(copies, pids)]  # where a warm rank computes
            measuring = 3 if copies and all(copies) else 8
            if len(ranks) == 2 and min(_cpu_seconds(p) for p in ranks) >= measuring:
                break
            time.sleep(0.2)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - stopped < 40
        assert proc.returncode != 0 and "bench: timing" in err and "over --collective-timeout 5 s" in err, err
    finally:
        if proc.poll() is None:
            from hpctrain.tools.launch import kill_tree
            kill_tree(proc.pid)
            proc.wait()


def test_an_unexpected_error_on_one_rank_leaves_its_traceback_in_the_log_it_names(digits2: Path, tmp_path: Path) -> None:
    """The one-line error says "traceback in RUN/logs/rank-0001.log"; the traceback used to be logged after the
    run had closed that log, so it went to the console and the log ended without it (found by the soak)."""
    run = tmp_path / "r"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "1",
                      "--model", f"{SCRIPTS / 'failing_model.py'}:factory"], check=False, timeout=120)
    log = run / "logs" / "rank-0001.log"
    assert proc.returncode == 1 and f"ZeroDivisionError: a bug in the user's forward (traceback in {log})" in proc.stderr, \
        proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr
    assert "Traceback (most recent call last)" in log.read_text() and "raise ZeroDivisionError" in log.read_text()


def test_a_stop_during_start_up_ends_the_job_there(digits2: Path, tmp_path: Path) -> None:
    """A stop while the ranks start (rank 1 takes 3 s longer to build its model): the job used to go through the
    whole start-up and the first step to checkpoint it, which on a busy node outlasted the launcher's --grace
    (exit 1; found by the soak). Now the ranks agree on the stop at their first collective and exit 3 with
    nothing to save; the same command then runs the job from the start."""
    from hpctrain.tools.launch import catches

    run = tmp_path / "r"
    args = ["--data", str(digits2), "--run-dir", str(run), "--max-steps", "5",
            "--model", f"{SCRIPTS / 'uneven_model.py'}:factory"]
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", *args],
                            env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both ranks' handlers are in: they are starting, not yet training
            ranks = [warmranks.copy_of(p) or p for p in _rank_pids(proc.pid)]  # a warm rank's own handlers
            if len(ranks) == 2 and all(catches(p, signal.SIGUSR2) for p in ranks):
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            from hpctrain.tools.launch import kill_tree
            kill_tree(proc.pid)
            proc.wait()
    assert proc.returncode == 3, (proc.returncode, err[-2000:])
    assert "during start-up, before step 1: nothing new to save" in err, err[-2000:]
    assert not list((run / "checkpoints").glob("step-*"))
    hpctrain(["launch", "-n", "2", "--", "train", *args])
    assert summary(run)["steps"] == 5 and summary(run)["resumed_from"] is None
