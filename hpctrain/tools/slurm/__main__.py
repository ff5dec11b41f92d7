"""`python -m hpctrain.tools.slurm rank|supervise`: the processes of the job that hpctrain runs itself.

The batch script `exec`s the supervisor, and every rank starts under the rank wrapper (see `supervise`). Both
are processes of the job, which Slurm may signal from their first instruction: the stop signals are held from
this module's first lines, before any other import, and `run_rank`/`supervise` take them over (and replay
what came meanwhile).
"""

from __future__ import annotations

import signal
import sys

_EARLY: list[int] = []  # stop signals that reached this process before run_rank/supervise took them over


def _hold_early(signum: int, frame: object) -> None:
    _EARLY.append(signum)


# `python -m hpctrain.tools.slurm rank|supervise` is itself a process of the job: Slurm may signal it from its first
# instruction. Hold the stop signals from here, before the imports below, until run_rank/supervise take over.
# (The package's __init__, imported before this module, imports nothing.)
if __name__ == "__main__" and sys.argv[1:2] in (["rank"], ["supervise"]):
    for _sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, _hold_early)
    # Started through `env --block-signal=USR2` (BLOCK_STOP): a SIGUSR2 that came meanwhile is pending; it
    # reaches _hold_early now. (Unblocked before any child starts: a child inherits the mask.)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})

import argparse  # noqa: E402 - after the early hold on purpose
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

from .supervise import run_rank, supervise  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.tools.slurm", description="hpctrain's in-job supervisor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sup = sub.add_parser("supervise", help="start the ranks, record the outcome, requeue after a checkpoint")
    sup.add_argument("--folder", type=Path, required=True)
    sup.add_argument("--max-requeues", type=int, default=10)
    sup.add_argument("--signal-delay", type=int, default=90)
    sup.add_argument("--sweep", type=Path, default=None, help="a job array's sweep file: append this element's flags")
    sup.add_argument("argv", nargs=argparse.REMAINDER)
    rank = sub.add_parser("rank", help="run one rank; a checkpointed stop (exit 3) exits 0 and is recorded")
    rank.add_argument("--folder", type=Path, required=True)
    rank.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("no command after --")
    try:
        if args.cmd == "rank":
            return run_rank(args.folder, command, early=_EARLY)
        return supervise(args.folder, command, max_requeues=args.max_requeues, signal_delay_s=args.signal_delay,
                         early=_EARLY, sweep=args.sweep)
    finally:
        # This process is done with the ranks: a stop that comes now (after the run's last step) must not kill
        # it on its way out (Python resets its own handlers to the default action while it exits).
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
