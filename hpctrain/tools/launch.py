"""`hpctrain launch`: run a command on N local ranks through `mpirun`, with what a workstation needs.

Adds the run-as-root variables when root, `--oversubscribe` when N exceeds the cores, `--bind-to none`
(ranks size their own thread pools), and runs hpctrain subcommands with this interpreter. mpirun runs in
its own session, so a Ctrl-C in the terminal reaches only the launcher; the first stop signal is handed
to mpirun as one it forwards to every rank (SIGINT or SIGTERM to mpirun would kill the ranks before they
can checkpoint): a person's (SIGINT, SIGUSR1) as SIGUSR1, a scheduler's (SIGTERM, SIGUSR2) as SIGUSR2, so
that the ranks record who asked (`stop.USER_STOPS`). A second one, or a job still running `--grace` seconds later, is ended hard,
so a stop always ends the job, within grace + 5 s. The exit code is the job's.

mpirun's stderr (its own messages and every rank's) passes through `MpirunFilter`: once a rank has said in a
line of its own what went wrong (`error: ...`, hpctrain's one-line errors), mpirun's reports of the failed
job (MPI_ABORT, "Primary job terminated normally, but 1 process returned...", "mpirun detected that one or
more processes exited...", help-aggregation and ORTE_ERROR_LOG lines) only repeat it in a dozen lines, and
are left out. Everything else of mpirun's stays (it cannot start a program, too few slots, a killed rank):
`--quiet` would hide those too.
"""

from __future__ import annotations

import os
import shutil
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

from ..base.rankenv import read_env
from ..base.errors import ConfigError, HpctrainError
from ..base.stop import FLAG, STOP_EXIT, STOP_SIGNALS, USER_STOPS, block_prefix, close_wakeup_pipe, wakeup_pipe

# hpctrain subcommands: a COMMAND starting with one of these runs as `python -m hpctrain ...`.
SUBCOMMANDS = ("train", "shard", "verify", "doctor", "bench", "report")
GRACE_S = 20.0  # after a stop signal, how long the ranks have to checkpoint and exit before the job is ended
KILL_AFTER_S = 5.0  # after SIGTERM to mpirun, how long before everything left is killed


def build_command(n: int, command: Sequence[str], *, mpirun: str, cpus: int, is_root: bool,
                  python: str = sys.executable, extra: Sequence[str] = (),
                  block: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The mpirun argument list and the extra environment for `n` ranks of `command` (a pure function).

    An hpctrain subcommand runs behind `block` (`stop.block_prefix()`): it starts with the stop signals
    blocked, so one that mpirun forwards while the rank's interpreter starts is pending, not fatal."""
    check_ranks(n)
    if not command:
        raise ConfigError("no COMMAND given: write e.g. `hpctrain launch -n 2 -- train --data data/ --run-dir runs/a`")
    argv = [mpirun, "-n", str(n), "--bind-to", "none"]
    if n > cpus:
        argv.append("--oversubscribe")
    argv += list(extra)
    if command[0] in SUBCOMMANDS:
        argv += [*block, python, "-m", "hpctrain", *command]
    else:
        argv += list(command)
    env = {}
    if is_root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return argv, env


def check_ranks(n: int) -> None:
    """Refuse a rank count no job can have, before anything (the shard check: it divides by it) uses it."""
    if n < 1:
        raise ConfigError(f"-n {n} must be at least 1 rank")


def precheck_train(data: Any, init_weights: Any, n: int, split: int = 1) -> None:
    """What `train` on `n` ranks would refuse at start-up and needs no MPI, checked once before mpirun starts
    them: the data is there and its shards divide among the ranks, the --init-weights file exists. A model
    split over `split` = tp x pp ranks has its layout checked at start-up, where the model is built (which
    layouts fit depends on it)."""
    from ..data.shardformat import load_manifest

    check_ranks(n)
    shards = load_manifest(data)
    if split == 1:
        shards.check_world(n)
    if init_weights is not None and not os.path.isfile(init_weights):
        raise ConfigError(f"--init-weights {str(init_weights)!r} not found")


def find_mpirun() -> str:
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path:
            return path
    raise HpctrainError(
        "no `mpirun` on PATH: install Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev), "
        "or run `hpctrain train` directly for a single rank"
    )


def launch(n: int, command: Sequence[str], *, extra: Sequence[str] = (), grace: float = GRACE_S) -> int:
    """Run `command` on `n` local ranks and return the job's exit code.

    The first stop signal asks every rank to stop at its next step boundary (through mpirun: see the module).
    A job that has not ended `grace` seconds later, or a second signal, ends it now: SIGTERM to mpirun (which
    kills the ranks), and KILL_AFTER_S later SIGKILL to mpirun and every process under it. So a stop always
    ends the job, even one whose ranks hang."""
    if not grace >= 0:
        raise ConfigError(f"--grace {grace} must be zero or more seconds, e.g. --grace 20")
    argv, env = build_command(n, command, mpirun=find_mpirun(), cpus=read_env().cpus_available,
                              is_root=os.geteuid() == 0, extra=extra, block=block_prefix())
    stops = 0
    proc: subprocess.Popen[bytes] | None = None
    deadline: float | None = None  # when the job is ended hard
    to_forward, relay = False, signal.SIGUSR2  # handed on once mpirun catches it (SIGUSR1: a person's stop)
    hard = False
    stalled_since: float | None = None
    next_look = 0.0

    def forward(signum: int, frame: object) -> None:
        nonlocal stops, deadline, to_forward, relay
        stops += 1
        if stops == 1:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"hpctrain launch: {what}: every rank writes a checkpoint at its next step and stops (within "
                  f"{grace:g} s; {what} again ends the job now)", file=sys.stderr, flush=True)
            to_forward, relay = True, (signal.SIGUSR1 if signum in USER_STOPS else signal.SIGUSR2)
            deadline = time.monotonic() + grace
            if proc is not None and catches(proc.pid, relay):  # at once: the ranks stop at the next step
                to_forward = False
                _send(proc.pid, relay)
        else:
            deadline = time.monotonic()

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    if FLAG.requested or stops:  # stopped while this process started (held by FLAG): the job never starts
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("hpctrain launch: a stop signal came before the job started; nothing was run", file=sys.stderr, flush=True)
        return STOP_EXIT
    proc, pump, waiter = _start(argv, {**os.environ, **env})
    try:
        while True:
            if to_forward and catches(proc.pid, relay):
                to_forward = False
                _send(proc.pid, relay)
            until = next_look if deadline is None else min(next_look, deadline)
            code = waiter.wait(0.05 if to_forward else until - time.monotonic())
            if code is not None:
                return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
            now = time.monotonic()
            if now >= next_look:  # once a second: ranks stopped (SIGSTOP) while the others have exited?
                next_look = now + 1.0
                ranks = children_states(proc.pid)  # fewer than n: some have exited
                stalled = 0 < len(ranks) < n and all(st == "T" for st in ranks.values())
                stalled_since = (stalled_since or now) if stalled else None
                if stalled_since is not None and now - stalled_since > grace and not hard:
                    print(f"hpctrain launch: rank process(es) {sorted(ranks)} stopped (SIGSTOP) for {grace:g} s while "
                          "the other ranks have exited; ending the job", file=sys.stderr, flush=True)
                    hard, deadline = True, now
            if deadline is not None and time.monotonic() >= deadline:
                if stalled_since is not None:  # a stopped rank: SIGTERM would wait for it, end it now
                    kill_tree(proc.pid)
                    deadline = None
                elif not hard:
                    print(f"hpctrain launch: the job did not stop within {grace:g} s of the stop signal (or a "
                          "second signal came); ending it now", file=sys.stderr, flush=True)
                    _send(proc.pid, signal.SIGTERM)
                    hard, deadline = True, time.monotonic() + KILL_AFTER_S
                else:
                    kill_tree(proc.pid)
                    deadline = None
    finally:
        waiter.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # the launcher itself failed: leave nothing running
            kill_tree(proc.pid)
            proc.wait(timeout=KILL_AFTER_S)
        pump.join(timeout=KILL_AFTER_S)  # the job's last lines (a rank that outlives mpirun may keep the pipe)


# mpirun's own reports of a job that failed: a block between separator lines, or one line with its pid
_SEPARATOR = b"-" * 74
_AFTERMATH = (b"MPI_ABORT was invoked", b"Primary job  terminated normally, but",
              b"mpirun detected that one or more processes exited with non-zero status")
_AFTERMATH_LINE = re.compile(rb"^\[[^\]\s]+:\d+\] (.*ORTE_ERROR_LOG|\d+ more process(es)? ha(s|ve) sent help message|"
                             rb"Set MCA parameter \"orte_base_help_aggregate\")")
_RANK_SAID = re.compile(rb"^(error: |stopped (by|at|during) )")  # a rank's one line: a failure or a stop
# mpirun's note that it passed a signal on (the launcher says so itself, in words). mpirun writes it in one
# write() at any byte of a rank's output, which shares the pipe: in the middle of a progress line too.
_FORWARDING = re.compile(rb"mpirun: Forwarding signal \d+ to job\n")


class MpirunFilter:
    """mpirun's stderr, passed on as it comes, less mpirun's reports of a failed job when a rank has said why in
    a line of its own. Those reports come as the job ends, so they are held until then and dropped only if
    such a line came, before or after them: which of a rank's last line and mpirun's report arrives first
    is a race. A line that might begin one (a `-` or `[` first) waits for its end; any other text, even half
    a line (a progress bar), is passed on at once."""

    def __init__(self, out: Callable[[bytes], None]):
        self.out = out
        self.pending = b""  # the start of a line not passed on yet
        self.passed = b""  # the start of a line already passed on
        self.block: list[bytes] | None = None  # a separator block being read
        self.held: list[bytes] = []
        self.rank_said = False

    def feed(self, data: bytes) -> None:
        self.pending += data
        if b"Forwarding" in self.pending:
            self.pending = _FORWARDING.sub(b"", self.pending)
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self._line(line + b"\n")
        if self.pending and self.block is None and (self.passed or self.pending[:1] not in (b"-", b"[")):
            self.out(self.pending)
            self.passed, self.pending = self.passed + self.pending, b""

    def _line(self, line: bytes) -> None:
        whole, passed, self.passed = self.passed + line, bool(self.passed), b""
        self.rank_said = self.rank_said or bool(_RANK_SAID.match(whole))
        if passed:
            self.out(line)
        elif self.block is not None:
            self.block.append(line)
            if line.rstrip() == _SEPARATOR:
                block, self.block = b"".join(self.block), None
                if any(mark in block for mark in _AFTERMATH):
                    self.held.append(block)
                else:
                    self.out(block)
        elif line.rstrip() == _SEPARATOR:
            self.block = [line]
        elif _AFTERMATH_LINE.match(line):
            self.held.append(line)
        else:
            self.out(line)

    def end(self) -> None:
        """The job ended: what is still held is passed on unless a rank said why it failed."""
        tail = b"".join(self.block or []) + self.pending
        self.block, self.pending = None, b""
        if tail:
            self.out(tail)
        if not self.rank_said:
            for text in self.held:
                self.out(text)
        self.held = []

    def pump(self, pipe: Any) -> None:
        """Read `pipe` (mpirun's stderr) to its end."""
        fd = pipe.fileno()
        try:
            while chunk := os.read(fd, 1 << 16):
                self.feed(chunk)
        except OSError:
            pass
        finally:
            self.end()
            pipe.close()


def _to_stderr(data: bytes) -> None:
    stream = getattr(sys.stderr, "buffer", None)
    if stream is None:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
        return
    sys.stderr.flush()
    stream.write(data)
    stream.flush()


class JobWaiter:
    """The launcher's sleep between its looks at the job: until mpirun exits (a pidfd), a signal comes (the
    wakeup pipe: the handler has run) or the timeout, so that a running job costs the launcher one wake-up
    a second. `Popen.wait(timeout)` polls instead, about 45 times a second here, and each wake-up takes the
    core of a rank for a moment (a synchronous step then waits for that rank). Where pidfds or the wakeup
    fd are not to be had (Linux before 5.3, off the main thread), it polls as Popen does."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        self.pipe: tuple[int, int, int] | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        if self.pidfd is not None:
            self.pipe = wakeup_pipe()

    def wait(self, timeout: float) -> int | None:
        """The job's exit code once it has ended, else None after at most `timeout` seconds."""
        timeout = max(0.0, timeout)
        if self.pidfd is None or self.pipe is None:
            try:
                return self.proc.wait(timeout=min(timeout, 0.2))
            except subprocess.TimeoutExpired:
                return None
        ready, _, _ = select.select([self.pidfd, self.pipe[0]], [], [], timeout)
        if self.pipe[0] in ready:
            try:
                os.read(self.pipe[0], 512)
            except OSError:
                pass
        return self.proc.poll()

    def close(self) -> None:
        if self.pipe is not None:
            close_wakeup_pipe(self.pipe)
            self.pipe = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _start(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], threading.Thread, JobWaiter]:
    """mpirun in its own session, its stderr read through `MpirunFilter` by a thread, and the launcher's sleep."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    pump = threading.Thread(target=MpirunFilter(_to_stderr).pump, args=(proc.stderr,), name="hpctrain-launch-stderr",
                            daemon=True)
    pump.start()
    return proc, pump, JobWaiter(proc)


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state letter)} of every process, read from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[0].decode())
    return table


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` now (its SigCgt mask in /proc): a program that has not yet
    installed one would die of a signal whose default action is to terminate."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in _processes().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def children_states(pid: int) -> dict[int, str]:
    """The live direct children of `pid` (mpirun's: the ranks on this node) and their state letter.

    A rank in state T was stopped (SIGSTOP) and goes on only if someone continues it. Stopped while the
    other ranks have already exited (it passed MPI_Finalize, so no peer's watchdog or deadline is left to
    notice), it would keep mpirun, and the job, waiting forever: the launcher ends such a job."""
    return {child: state for child, (parent, state) in _processes().items() if parent == pid and state != "Z"}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything under it (mpirun's ranks do not always share its process group)."""
    for victim in [pid, *descendants(pid)]:
        _send(victim, signal.SIGKILL)
