"""Inside the job: the supervisor (`supervise`), the rank wrapper (`run_rank`) and the stop relay between them
and the processes they start. Both run as `python -m hpctrain.tools.slurm supervise|rank` (see `__main__`).

The supervisor runs as the batch shell of the job. It keeps the job's record (FOLDER/JOBID_hpctrain.jsonl;
JOBID_TASK_hpctrain.jsonl for an element of a job array, which requeues alone, as `scontrol requeue JOBID_TASK`) and
decides what an exit means: 0 completed; 3 (every rank stopped on a stop signal and wrote one checkpoint
together) after SIGTERM/SIGUSR2 is a preemption or a timeout, and the job requeues itself (`scontrol requeue`)
up to `max_requeues` times to resume with `--resume auto`; after SIGINT (`scancel --signal=INT`: a person
asked) it is a stop, never requeued; any other code is a failure and never requeues. The rank wrapper
forwards signals, notes the first failing rank, and turns the collective stop (exit 3) into exit 0 so
--kill-on-bad-exit does not kill ranks still finishing theirs.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ...base.rankenv import read_env
from ...base.stop import STOP_EXIT  # every rank stopped at a step boundary and checkpointed
from ..launch import descendants
from ...base.errors import SubmissionError
from .core import job_key, parse_duration, read_record, record, run_slurm, slurm_job
from .render import BLOCK_STOP
from .sweep import element_args


class _StopRelay:
    """Hands the stop signal (SIGUSR2) to a child process only once the child can take it.

    The child starts with SIGUSR2 ignored (`start`), so a stop that reaches it directly (Slurm signals every
    process of the step) before it has a handler, say while Python imports torch, neither kills it nor counts:
    this process keeps every SIGUSR2 it gets and hands it on as soon as the child, or a process under it (a
    shell script's program), catches SIGUSR2 (SigCgt in /proc/PID/status). Where /proc cannot tell, it hands
    it on at once. SIGTERM and SIGINT go to the child at once: their default action is what they ask for.
    Every handler only sets a flag or sends a signal, so duplicates (Slurm's own copy and ours) are harmless.
    """

    def __init__(self, passed: Sequence[int]) -> None:
        self.passed = tuple(passed)  # signals handed on at once
        self.proc: subprocess.Popen | None = None
        self.pending = 0  # SIGUSR2s received and not yet handed on
        self.delivered = 0  # SIGUSR2s handed on to a process that catches it
        self.received: list[int] = []
        self._passed_early: list[int] = []  # SIGTERM/SIGINT that came before the child existed
        self._owner = os.getpid()
        self._proc_fs = os.path.isdir(f"/proc/{self._owner}")
        self._previous: dict[int, Any] = {}

    def install(self, early: list[int]) -> None:
        """Take this relay's signals over from the early hold, replaying what it caught of them (`early`: the
        signals held so far, see `__main__`; the ones taken here are removed from it)."""
        mine = (signal.SIGUSR2, *self.passed)
        for sig in mine:
            self._previous[sig] = signal.signal(sig, self._handle)
        caught = [sig for sig in early if sig in mine]
        early[:] = [sig for sig in early if sig not in mine]
        for sig in caught:
            self._handle(sig, None)

    def start(self, argv: Sequence[str]) -> subprocess.Popen:
        """Start the child with SIGUSR2 ignored, then hand on whatever arrived meanwhile."""
        self.proc = subprocess.Popen(list(argv), preexec_fn=_ignore_stop_signal)
        for sig in self._passed_early:
            self._send(self.proc.pid, sig)
        self._passed_early.clear()
        self.relay()
        return self.proc

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner:  # in the child between fork and exec: not this process's signal
            return
        self.received.append(signum)
        if signum != signal.SIGUSR2:
            if self.proc is None:
                self._passed_early.append(signum)
            elif self.proc.returncode is None:
                self._send(self.proc.pid, signum)
            return
        self.pending += 1
        self.relay()

    def relay(self) -> None:
        """Hand the held SIGUSR2 on if a process of the child can take it now."""
        if not self.pending or self.proc is None or self.proc.returncode is not None:
            return
        targets = self._catchers(self.proc.pid)
        if targets:
            self.pending = 0
            self.delivered += 1
            for pid in targets:
                self._send(pid, signal.SIGUSR2)

    def _catchers(self, pid: int) -> list[int]:
        if not self._proc_fs:
            return [pid]
        if _catches(pid, signal.SIGUSR2):
            return [pid]
        return [p for p in descendants(pid) if _catches(p, signal.SIGUSR2)]

    def wait(self) -> int:
        """Wait for the child, relaying a held SIGUSR2 while it starts; then ignore SIGUSR2 (a stop after the end
        must not kill this process while it records and exits). Returns the child's code, 128+N for signal N."""
        assert self.proc is not None
        polls = 0  # while a SIGUSR2 is held: look often at first (a trainer installs its handler within seconds)
        while True:
            polls = polls + 1 if self.pending else 0
            try:
                code = self.proc.wait(timeout=0.5 if not self.pending or polls > 200 else 0.05)
                break
            except subprocess.TimeoutExpired:
                self.relay()
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return code if code >= 0 else 128 - code

    def restore(self) -> None:
        """Give the signals back to their previous handlers (in a job process: the early hold, see `__main__`)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def _send(pid: int, signum: int) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _ignore_stop_signal() -> None:
    """In the child, before exec: SIGUSR2 ignored until the program installs its own handler (exec keeps an
    ignored signal ignored), so a stop during its start-up waits in the parent instead of killing it."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _launchable(launcher: Sequence[str]) -> list[str]:
    """`launcher` as this node can run it: without BLOCK_STOP before the rank wrapper where `env` cannot block
    signals (coreutils before 8.31, e.g. RHEL 8), saying so; the ranks then start as they did before it."""
    argv, n = list(launcher), len(BLOCK_STOP)
    at = next((i for i in range(len(argv) - n) if tuple(argv[i:i + n]) == BLOCK_STOP
               and argv[i + n + 1:i + n + 5] == ["-u", "-m", "hpctrain.tools.slurm", "rank"]), None)
    if at is None:
        return argv
    try:
        works = subprocess.run([*BLOCK_STOP, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    if works:
        return argv
    print(f"hpctrain: `{' '.join(BLOCK_STOP)}` does not work on this node (GNU coreutils >= 8.31 has it); ranks "
          "start without it: a SIGUSR2 in a rank's first few milliseconds may end that rank", file=sys.stderr, flush=True)
    return argv[:at] + argv[at + n:]


def supervise(folder: Path, launcher: Sequence[str], *, max_requeues: int, signal_delay_s: int,
              early: list[int] | None = None, sweep: Path | None = None) -> int:
    """Run the ranks through `launcher`, record what happened, and requeue after a checkpointed stop.

    Runs as the batch shell of the job (the script `exec`s it). Returns the exit code of the job step.
    `early`: the stop signals this process held before this call (see `__main__`), taken over here.
    `sweep`: the sweep file of a job array; this element's arguments (by its array index) are appended to
    `launcher` (see `sweep`).
    """
    early = [] if early is None else early
    # SIGUSR2 reaches the supervisor from `B:USR2@T` (mpirun) or `scancel --full/--batch`: srun and mpirun
    # forward it to every rank, so it goes to the launcher once the launcher handles it. SIGTERM reaches the
    # ranks from Slurm directly (scancel, preemption); here it must not kill the supervisor before the ranks
    # have written their checkpoint.
    relay = _StopRelay(passed=())
    relay.install(early)
    previous_term = signal.signal(signal.SIGTERM, lambda s, f: relay.received.append(s))
    previous_int = signal.signal(signal.SIGINT, lambda s, f: relay.received.append(s))  # a person's stop: noted
    relay.received.extend(early)  # a SIGTERM or SIGINT held before this line
    early.clear()
    try:
        if sweep is not None:
            env = read_env()
            try:
                launcher = [*launcher, *element_args(sweep, env.array_task_id)]
            except SubmissionError as exc:
                record(folder, job_key(env), "failed", restart=env.restart_count, exit_code=2, note=str(exc))
                print(f"hpctrain: {exc}", file=sys.stderr, flush=True)
                return 2
        return _supervise(relay, folder, launcher, max_requeues=max_requeues, signal_delay_s=signal_delay_s)
    finally:
        relay.restore()
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)


def _supervise(relay: _StopRelay, folder: Path, launcher: Sequence[str], *, max_requeues: int,
               signal_delay_s: int) -> int:
    env = read_env()
    job_id = job_key(env)
    folder = Path(folder)
    restart = env.restart_count
    record(folder, job_id, "start", restart=restart, node=env.node_name, pid=os.getpid())
    launcher = _launchable(launcher)
    print(f"hpctrain: job {job_id} start {restart} on {env.node_name}: {shlex.join(launcher)}", file=sys.stderr, flush=True)
    relay.start(launcher)
    code = relay.wait()
    events = [e for e in read_record(folder, job_id) if e.get("restart") == restart]
    stopped = any(e.get("event") == "ranks_stopped" for e in events)
    failed = [e for e in events if e.get("event") == "rank_failed"]
    if code == 0 and not stopped:
        record(folder, job_id, "completed", restart=restart, exit_code=0)
        return 0
    if code == 0:
        code = STOP_EXIT
    if code != STOP_EXIT:
        first = min(failed, key=lambda e: (e["exit_code"] >= 128, e["time"]), default=None)
        if first is not None:
            code = first["exit_code"]
        rank = None if first is None else first.get("rank")
        record(folder, job_id, "failed", restart=restart, exit_code=code, rank=rank)
        print(f"hpctrain: job {job_id} failed (rank {rank}, exit code {code}); not requeued", file=sys.stderr, flush=True)
        return code
    # Every rank stopped at a step boundary and the checkpoint is complete. Why?
    if signal.SIGINT in relay.received or any(e.get("asked_by") == "user" for e in events):
        record(folder, job_id, "stopped", reason="user", restart=restart, exit_code=code,
               note="a person asked (SIGINT): not requeued")
        print(f"hpctrain: job {job_id} stopped as asked (SIGINT) after a checkpoint; not requeued", file=sys.stderr,
              flush=True)
        return code
    info = slurm_job(job_id) or {}
    state = info.get("JobState", "")
    if state and state != "RUNNING":
        # Slurm ends the job itself: preemption (Slurm requeues or cancels it) or scancel (COMPLETING/CANCELLED).
        slurm_preempts = "PREEMPT" in state or "REQUEUE" in state
        record(folder, job_id, "preempted" if slurm_preempts else "cancelled", restart=restart, exit_code=code,
               slurm_state=state)
        return code
    left = _time_left(job_id)
    reason = stop_reason(left, signal_delay_s)
    if restart >= max_requeues:
        record(folder, job_id, "stopped", reason=reason, restart=restart, exit_code=code,
               note=f"requeue limit {max_requeues} reached")
        print(f"hpctrain: job {job_id} stopped ({reason}); requeue limit {max_requeues} reached", file=sys.stderr, flush=True)
        return code
    record(folder, job_id, "requeued", reason=reason, restart=restart, exit_code=code, time_left_s=left)
    print(f"hpctrain: job {job_id} stopped ({reason}) after a checkpoint; requeueing", file=sys.stderr, flush=True)
    terms = relay.received.count(signal.SIGTERM)
    proc_rq = run_slurm(["scontrol", "requeue", job_id])
    # Slurm ends the allocation the moment the requeue takes, and its SIGTERM can reach scontrol (a process of
    # the job) before scontrol exits: killed by SIGTERM or SIGKILL, it did requeue.
    if proc_rq.returncode != 0 and -proc_rq.returncode not in (signal.SIGTERM, signal.SIGKILL):
        record(folder, job_id, "stopped", reason=reason, restart=restart, exit_code=code,
               note=f"scontrol requeue failed: {(proc_rq.stderr or proc_rq.stdout).strip()}")
        return code
    # Slurm now ends this allocation (SIGTERM, then SIGKILL): leave on the first (returning before it would end
    # the job as COMPLETED instead of requeued), or now if it came already.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if relay.received.count(signal.SIGTERM) == terms:
        time.sleep(60)
    return code


def run_rank(folder: Path, argv: Sequence[str], *, early: list[int] | None = None) -> int:
    """Run one rank's command; a checkpointed stop (exit 3) becomes exit 0 and, on rank 0, a record event.

    Holds SIGUSR2 until the command handles it (see `_StopRelay`): Slurm signals this wrapper and the command
    alike, and a trainer still importing torch would otherwise die of it. SIGTERM and SIGINT are passed on at
    once (Slurm may signal only this process, as mpirun does). `early`: the stop signals this process held
    before this call (see `__main__`), taken over here.
    """
    relay = _StopRelay(passed=(signal.SIGTERM, signal.SIGINT))
    relay.install([] if early is None else early)
    try:
        env = read_env()
        relay.start(argv)
        code = relay.wait()
    finally:
        relay.restore()
    rank = env.rank or 0
    if relay.pending:
        print(f"hpctrain: rank {rank}: a SIGUSR2 came while the program did not handle it (not yet, or no longer "
              f"after its last step); it exited with code {code}", file=sys.stderr, flush=True)
    elif relay.delivered and code == 0:
        print(f"hpctrain: rank {rank}: SIGUSR2 was handed to the program, which then completed (exit 0) instead of "
              "stopping: the signal came after its last step", file=sys.stderr, flush=True)
    if code == STOP_EXIT:
        if rank == 0:  # Slurm signals every task alike: what reached this wrapper reached the ranks
            record(folder, job_key(env), "ranks_stopped", restart=env.restart_count, exit_code=code,
                   asked_by="user" if signal.SIGINT in relay.received else "scheduler")
        return 0
    if code:  # srun reports only the largest code (often a rank it killed); keep who failed first, and how
        record(folder, job_key(env), "rank_failed", restart=env.restart_count, rank=env.rank, exit_code=code)
    return code


def stop_reason(time_left_s: int | None, signal_delay_s: int) -> str:
    """Why every rank stopped: "timeout" when the job was near its time limit (Slurm's USR2 comes
    `signal_delay_s` before it; 30 s of slack for the step to finish), else "preempted" (scancel --signal,
    a preemption, an admin)."""
    return "timeout" if time_left_s is not None and time_left_s <= signal_delay_s + 30 else "preempted"


def _time_left(job_id: str) -> int | None:
    proc = run_slurm(["squeue", "-h", "-j", str(job_id), "-o", "%L"], timeout=10)
    return parse_duration(proc.stdout) if proc.returncode == 0 else None
