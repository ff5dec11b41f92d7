"""`hpctrain doctor`: check MPI, mpi4py, CUDA-aware support, GPUs, the launcher, HDF5 and threads on every rank."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import handle_errors, is_rank0


@handle_errors
def doctor(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when any rank has a problem (for scripts and "
                                         "an image's %test).")] = False,
) -> None:
    """Check MPI, mpi4py, CUDA-aware support, GPUs, Slurm, HDF5 and threads; print each problem with its fix.

    Run it the way you run training (e.g. under srun or mpirun) to check every rank.

    Example: srun --mpi=pmix -n 2 hpctrain doctor --json
    """
    from ..tools.doctor import doctor as run, format_report

    report = run()
    if is_rank0():
        print(json.dumps(report) if json_out else format_report(report), flush=True)
    if strict and not report["ok"]:
        raise typer.Exit(1)


@handle_errors
def info(
    json_out: Annotated[bool, typer.Option("--json", help="Print the facts as one JSON object.")] = False,
) -> None:
    """Print the versions of hpctrain, Python, torch, the MPI library, mpi4py, HDF5 and h5py, and which optional
    features this install has (tokenizers, Parquet, TensorBoard, Slurm, containers).

    One process, no launcher needed; `hpctrain doctor` checks every rank of a job instead.

    Example: hpctrain info
    """
    from ..tools.info import format_info, info as collect

    facts = collect()
    print(json.dumps(facts) if json_out else format_info(facts), flush=True)
