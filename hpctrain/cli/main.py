"""The `hpctrain` application: registers the command groups."""

from __future__ import annotations

import gc
import sys
from typing import Annotated

import typer

from ..base.rankenv import read_env
from ..base.stop import FLAG, finishing, unblock
from .common import usage_error
from .helpformat import App

app = App(
    name="hpctrain",
    help="Data-parallel PyTorch training over MPI, from a laptop to a Slurm supercomputer.\n\n"
    "Example: hpctrain shard digits data/ --shards 2 && hpctrain launch -n 2 -- train --data data/ --run-dir runs/a",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"hpctrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print hpctrain's version and exit.")] = False) -> None:
    """The options of `hpctrain` itself (the app's help is above)."""


def _register(only_train: bool) -> None:
    """The commands, in the order `--help` lists them. For `hpctrain train`, what every rank runs, train alone:
    a rank then imports no other command's modules (Slurm, containers, benchmarks) before its first step."""
    from . import train

    if only_train:
        app.command()(train.train)
        return
    from . import bench, container, doctor, generate, launch, plan, report, shard, submit

    app.command()(shard.shard)
    app.command()(shard.verify)
    app.command()(train.train)
    app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(launch.launch)
    app.command()(doctor.doctor)
    app.command()(doctor.info)
    app.command()(report.report)
    app.command()(plan.plan)
    app.command()(generate.generate)
    submit.register(app)
    app.add_typer(container.app, name="container")
    app.add_typer(bench.app, name="bench")


_register(sys.argv[1:2] == ["train"])


def _run() -> None:
    """Run the app. In a rank of a job of two or more (`mpirun -n 2 hpctrain train --bad`), a usage error is
    printed once, by rank 0, on one line, instead of the usage box once per rank."""
    job = read_env()
    if (job.world_size or 1) < 2:
        app(prog_name="hpctrain")
        return
    try:
        code = app(prog_name="hpctrain", standalone_mode=False)
    except Exception as exc:  # click's UsageError (or Abort), of whichever click Typer ships
        message = usage_error(exc, getattr(getattr(exc, "ctx", None), "command_path", None) or "hpctrain")
        if message is None and type(exc).__name__ != "Abort":
            raise
        if message is not None and job.rank in (None, 0):
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(getattr(exc, "exit_code", 1) if message is not None else 1)
    sys.exit(code if isinstance(code, int) else 0)  # an Exit's code (a command itself returns None)


def _whole_lines() -> None:
    """Each line printed goes out in one write, at once: under PYTHONUNBUFFERED=1, print() would write its
    pieces one by one, and mpirun or srun, forwarding every rank's writes as they come, would break one rank's
    line with another's; block-buffered (a pipe without it), progress would come late."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent when a caller replaced the stream
        if reconfigure is not None:
            reconfigure(write_through=False, line_buffering=True)


def main() -> None:
    """The process entry (console script and `python -m hpctrain`)."""
    _whole_lines()
    training = sys.argv[1:2] == ["train"]
    if training or sys.argv[1:2] == ["launch"]:  # a stop during start-up is kept: for the first step boundary,
        FLAG.install()  # or, in the launcher, to end the job before it starts
    unblock()
    try:
        _run()
    finally:
        # What is alive now lives until the exit: the interpreter's teardown need not search it for cycles.
        # With torch (and the torch._dynamo that its optimizers import) that search is ~1 s per process.
        gc.freeze()
        if training or sys.argv[1:2] == ["bench"]:  # both set the exit budget: MPI_Finalize waits for every rank
            finishing(FLAG.exit_budget)
