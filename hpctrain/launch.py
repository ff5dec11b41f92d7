"""`hpctrain launch`: run a command on N local ranks through `mpirun`, with what a workstation needs.

Adds the run-as-root variables when root, `--oversubscribe` when N exceeds the cores, `--bind-to none`
(ranks size their own thread pools), and runs hpctrain subcommands with this interpreter. mpirun runs in
its own session, so a Ctrl-C in the terminal reaches only the launcher; the first SIGINT or SIGTERM is
turned into SIGUSR2 for mpirun, which forwards it to every rank (SIGTERM to mpirun would kill the ranks
before they can checkpoint). A second one stops the job hard. The exit code is the job's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Sequence

from .errors import ConfigError, HpctrainError

# hpctrain subcommands: a COMMAND starting with one of these runs as `python -m hpctrain ...`.
SUBCOMMANDS = ("train", "shard", "verify", "doctor", "bench", "report")


def build_command(n: int, command: Sequence[str], *, mpirun: str, cpus: int, is_root: bool,
                  python: str = sys.executable, extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The mpirun argument list and the extra environment for `n` ranks of `command` (a pure function)."""
    if n < 1:
        raise ConfigError(f"-n {n} must be at least 1 rank")
    if not command:
        raise ConfigError("no COMMAND given: write e.g. `hpctrain launch -n 2 -- train --data data/ --run-dir runs/a`")
    argv = [mpirun, "-n", str(n), "--bind-to", "none"]
    if n > cpus:
        argv.append("--oversubscribe")
    argv += list(extra)
    if command[0] in SUBCOMMANDS:
        argv += [python, "-m", "hpctrain", *command]
    else:
        argv += list(command)
    env = {}
    if is_root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return argv, env


def find_mpirun() -> str:
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path:
            return path
    raise HpctrainError(
        "no `mpirun` on PATH: install Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev), "
        "or run `hpctrain train` directly for a single rank"
    )


def launch(n: int, command: Sequence[str], *, extra: Sequence[str] = ()) -> int:
    """Run `command` on `n` local ranks and return the job's exit code."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 1
    argv, env = build_command(n, command, mpirun=find_mpirun(), cpus=cpus, is_root=os.geteuid() == 0, extra=extra)
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    stops = 0

    def forward(signum: int, frame: object) -> None:
        nonlocal stops
        stops += 1
        try:
            # First: a graceful stop every rank can act on. Second: stop now.
            os.kill(proc.pid, signal.SIGUSR2 if stops == 1 else signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        while True:
            try:
                return proc.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
