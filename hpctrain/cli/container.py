"""`hpctrain container recipe | build` (issue 6: being written)."""

import typer

app = typer.Typer(help="Apptainer images with CUDA-aware Open MPI.", no_args_is_help=True)
