"""`hpctrain launch`: local mpirun with the right flags."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .common import handle_errors


@handle_errors
def launch(
    command: Annotated[list[str], typer.Argument(help="An hpctrain subcommand (train ...) or any program.")],
    n: Annotated[int, typer.Option("-n", "--np", help="Number of ranks.")] = 2,
    grace: Annotated[float, typer.Option(help="Seconds the ranks get to checkpoint and exit after a stop signal before the job is ended hard.")] = 20.0,
) -> None:
    """Run COMMAND on N local ranks through mpirun (root, oversubscription and signals handled).

    Example: hpctrain launch -n 2 -- train --data data/ --run-dir runs/a
    """
    from ..tools.launch import launch as run, precheck_train

    if command[:1] == ["train"]:  # what needs no MPI is checked here, once, before mpirun starts N ranks
        from .train import config_from_args

        cfg = config_from_args(command[1:])
        if cfg is None:  # --help, printed once
            return
        precheck_train(cfg.data.path, cfg.model.init_weights, n, cfg.parallel.tp * cfg.parallel.pp)
    if sys.stderr.isatty():  # at once: a rank's first line comes after it has imported torch and joined MPI
        print(f"hpctrain launch: starting {command[0]} on {n} rank(s); each imports torch and joins MPI before "
              "its first step", file=sys.stderr, flush=True)  # piped or logged, the run's first line is its own
    raise typer.Exit(run(n, command, grace=grace))
