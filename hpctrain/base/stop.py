"""How a run's process stops: on request, and by deadline where no Python thread can watch it.

A stop is asked for by a scheduler (SIGTERM: a preemption; SIGUSR2: the time limit's warning; the Slurm
supervisor requeues the job after it) or by a person (SIGINT: Ctrl-C, `scancel --signal=INT`; SIGUSR1:
`hpctrain launch` hands a Ctrl-C on as SIGUSR1, since mpirun forwards neither SIGINT nor SIGTERM; never
requeued). A signal handler only sets a flag; the ranks agree on it at the next step boundary, write one
checkpoint together and exit with `STOP_EXIT`, whoever asked. A second Ctrl-C ends the process at once
(KeyboardInterrupt), as a program that ignores the first would otherwise never end; a copy of the first
(Slurm signals a task and its wrapper, which passes it on) is not a second one.

There is one flag per process, installed as early as possible (`python -m hpctrain train` does it before
importing anything slow), so a stop that arrives while the process is still starting is kept for the first
step boundary instead of killing the rank (the default action of SIGUSR2 is to terminate).
"""

from __future__ import annotations

import faulthandler
import functools
import math
import os
import signal
import sys
import threading
import time
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGUSR1)
USER_STOPS = (signal.SIGINT, signal.SIGUSR1)  # a person asked: the job is not requeued
STOP_EXIT = 3  # every rank stopped at a step boundary and the checkpoint is written: resume with --resume auto
AGAIN_S = 1.0  # a SIGINT this long after the first is a second Ctrl-C; sooner, a copy (Slurm's and a wrapper's)
EDGE_FLOOR_S = 60.0  # the start-up and exit deadlines are never shorter: see edge_budget


def edge_budget(collective_timeout: float) -> float:
    """How long a rank may wait at the edges of a run, in MPI_Init and MPI_Finalize, for its peers: the
    collective timeout, but at least EDGE_FLOOR_S (0: never). There the wait also holds a peer's start-up or
    teardown (importing torch, freeing its memory), which on an oversubscribed, busy node takes more than a
    short --collective-timeout while nothing is wrong; a rank stopped there is still found, a minute later."""
    return 0.0 if collective_timeout <= 0 else max(collective_timeout, EDGE_FLOOR_S)


def wakeup_pipe() -> tuple[int, int, int] | None:
    """(read end, write end, the previous wakeup fd) of a pipe that receives the number of each signal Python
    handles (signal.set_wakeup_fd), so that a thread sleeping in select() on it wakes at once; None off the
    main thread (library use: the caller owns the process's signals). Give back with `close_wakeup_pipe`."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:
        os.close(read)
        os.close(write)
        return None
    return read, write, previous


def close_wakeup_pipe(pipe: tuple[int, int, int]) -> None:
    """Put back the wakeup fd `wakeup_pipe` replaced, and close its pipe (on the main thread)."""
    read, write, previous = pipe
    signal.set_wakeup_fd(previous)
    os.close(read)
    os.close(write)


class StopFlag:
    """Set by the stop signals once installed; read at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal
        self.user = False  # a person asked, by any of the signals that came (USER_STOPS)
        self.interrupted: float | None = None  # when the first SIGINT came: a second one ends the process
        self._previous: dict[int, Any] = {}
        self.exit_budget = 0.0  # seconds the process may take to exit after the run (see finishing)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> bool:
        """Route the stop signals to this flag; False when it already was (or when not in the main thread,
        where signals stay with the caller: library use)."""
        if self._previous:
            return False
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                return False
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted is not None and now - self.interrupted >= AGAIN_S:
                raise KeyboardInterrupt
            if self.interrupted is None and os.isatty(2):  # a Ctrl-C in a terminal: say what happens now
                os.write(2, b"\nCtrl-C: writing a checkpoint at the next step and stopping (Ctrl-C again ends now)\n")
            self.interrupted = self.interrupted if self.interrupted is not None else now
        self.user = self.user or signum in USER_STOPS
        if self.signum is None:
            self.signum = signum

    def restore(self) -> None:
        """Give the signals back to their previous handlers, and forget the request."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.signum, self.user, self.interrupted = None, False, None


FLAG = StopFlag()


def unblock() -> None:
    """Let the stop signals in. A process started through `block_prefix()` holds them blocked, pending and not
    lost, from before its exec; once its handler is in, this delivers what came meanwhile to the handler."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@functools.cache
def block_prefix() -> tuple[str, ...]:
    """The argument list prefix that starts a program with the stop signals blocked across exec (GNU env,
    coreutils >= 8.31), or () where `env` cannot (the program then has a few milliseconds of start-up in which
    a stop signal ends it by default). A Python process started so calls `unblock()` once its handler is in:
    `python -m hpctrain` does."""
    import shutil  # here, not at the top: this module is imported first thing at start-up, and must be quick
    import subprocess

    env = shutil.which("env")
    block = ("--block-signal=" + ",".join(sig.name.removeprefix("SIG") for sig in STOP_SIGNALS),)
    try:
        ok = env is not None and subprocess.run([env, *block, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (env, *block) if ok else ()


def deadline(seconds: float) -> None:
    """End this process (exit 1, after printing every thread's stack on stderr) if it still runs `seconds`
    from now, whatever it is doing. A C thread (faulthandler's) keeps this time, so it works where no Python
    thread can run: inside MPI_Init or MPI_Finalize, which wait for every rank, also for one that is stopped
    and will never come. The rank's exit then makes the launcher end the whole job. 0: no deadline."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)


def cancel_deadline() -> None:
    """The watchdog thread has taken over (or the wait is over)."""
    faulthandler.cancel_dump_traceback_later()


def finishing(seconds: float) -> None:
    """The run is over and the process is about to exit: a stop signal now is moot, so ignore it (also while
    the interpreter tears down, when Python would otherwise give SIGUSR2 back its default action: death),
    and be gone within `seconds` even if MPI_Finalize waits for a rank that is stuck.

    The deadline here is the kernel's (SIGALRM, default action: end the process, exit 128 + 14), not
    faulthandler's: mpi4py calls MPI_Finalize at the very end of the interpreter's teardown, after
    faulthandler's thread is gone."""
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread: library use, the caller owns the process
            return
    FLAG._previous.clear()
    if seconds > 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(seconds)))
