"""The `hpctrain` application: registers the command groups."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..base.stop import FLAG, finishing, unblock
from . import bench, container, doctor, generate, launch, report, shard, submit, train
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


app.command()(shard.shard)
app.command()(shard.verify)
app.command()(train.train)
app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(launch.launch)
app.command()(doctor.doctor)
app.command()(doctor.info)
app.command()(report.report)
app.command()(generate.generate)
submit.register(app)
app.add_typer(container.app, name="container")
app.add_typer(bench.app, name="bench")


def main() -> None:
    """The process entry (console script and `python -m hpctrain`)."""
    training = sys.argv[1:2] == ["train"]
    if training or sys.argv[1:2] == ["launch"]:  # a stop during start-up is kept: for the first step boundary,
        FLAG.install()  # or, in the launcher, to end the job before it starts
    unblock()
    try:
        app(prog_name="hpctrain")
    finally:
        if training or sys.argv[1:2] == ["bench"]:  # both set the exit budget: MPI_Finalize waits for every rank
            finishing(FLAG.exit_budget)
