"""`hpctrain container recipe | build`: Apptainer images with CUDA-aware Open MPI, mpi4py and torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..base.errors import ConfigError
from ..tools.containers import MODES, MPI_ABIS, ContainerConfig
from .common import handle_errors
from .helpformat import App

app = App(
    help="Apptainer images with CUDA-aware Open MPI, mpi4py and torch.\n\n"
    "Example: hpctrain container recipe -o hpctrain.def && hpctrain container build hpctrain.def -o hpctrain.sif",
    no_args_is_help=True,
)

_D = ContainerConfig()  # the defaults, shown in --help (hpccm is imported only when rendering)


@app.command()
@handle_errors
def recipe(
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the definition here (FILE.def); "
                                                   "default: print it.")] = None,
    mode: Annotated[str, typer.Option(help=f"{' or '.join(MODES)}: the image's own CUDA-aware Open MPI, or the "
                                      "host's MPI bound in at run time.")] = _D.mode,
    mpi_abi: Annotated[str, typer.Option(help=f"{' or '.join(MPI_ABIS)}: the MPI ABI mpi4py is built against "
                                         "(mpich needs --mode bind).")] = _D.mpi_abi,
    cuda: Annotated[str, typer.Option(help="CUDA version of the nvidia/cuda base images (X.Y.Z).")] = _D.cuda,
    devel_digest: Annotated[Optional[str], typer.Option(help="sha256:... digest pinning the devel base image.")] = None,
    runtime_digest: Annotated[Optional[str], typer.Option(help="sha256:... digest pinning the runtime base "
                                                          "image.")] = None,
    openmpi: Annotated[str, typer.Option(help="Open MPI version (hybrid: 5.0+; bind: the ABI placeholder).")] = _D.openmpi,
    ucx: Annotated[str, typer.Option(help="UCX version (hybrid).")] = _D.ucx,
    pmix: Annotated[str, typer.Option(help="OpenPMIx version (hybrid).")] = _D.pmix,
    gdrcopy: Annotated[str, typer.Option(help="gdrcopy version (hybrid).")] = _D.gdrcopy,
    mpich: Annotated[str, typer.Option(help="MPICH version of the placeholder (bind, --mpi-abi mpich).")] = _D.mpich,
    mpi4py: Annotated[str, typer.Option(help="mpi4py version, compiled against the image's MPI.")] = _D.mpi4py,
    torch: Annotated[str, typer.Option(help="PyTorch version.")] = _D.torch,
    torch_index: Annotated[Optional[str], typer.Option(help="pip index for torch (default: "
                                                       "https://download.pytorch.org/whl/cuXY for --cuda X.Y).")] = None,
    write_defaults: Annotated[Optional[Path], typer.Option(
        "--write-defaults", metavar="DIR", file_okay=False,
        help="Instead, render the default recipes (those checked in under containers/) into DIR.")] = None,
) -> None:
    """Write an Apptainer definition: CUDA base, UCX, PMIx, Open MPI, mpi4py from source, torch and hpctrain.

    Example: hpctrain container recipe --mode hybrid -o hpctrain.def
    """
    from ..tools.containers import render_recipe, write_defaults as render_defaults

    cfg = ContainerConfig(mode=mode, mpi_abi=mpi_abi, cuda=cuda, devel_digest=devel_digest,
                          runtime_digest=runtime_digest, openmpi=openmpi, ucx=ucx, pmix=pmix, gdrcopy=gdrcopy,
                          mpich=mpich, mpi4py=mpi4py, torch=torch, torch_index=torch_index)
    if write_defaults is not None:
        if output is not None or cfg != ContainerConfig():
            raise ConfigError("--write-defaults renders the default recipes with their own options: leave out -o "
                              "and the image options")
        for path in render_defaults(write_defaults):
            print(f"wrote {path}")
        return
    text = render_recipe(cfg)
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(f"wrote {output} ({cfg.mode} image, {cfg.mpi_abi} ABI, CUDA {cfg.cuda}, torch {cfg.torch}); "
          f"build it with: hpctrain container build {output} -o {output.with_suffix('.sif').name}")


@app.command()
@handle_errors
def build(
    definition: Annotated[Path, typer.Argument(help="An Apptainer definition (from `hpctrain container recipe`).")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="The image to write (FILE.sif); "
                                                   "default: the definition's name with .sif, here.")] = None,
    fakeroot: Annotated[bool, typer.Option("--fakeroot", help="Build as an unprivileged user "
                                           "(apptainer build --fakeroot).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing image.")] = False,
    nv: Annotated[bool, typer.Option("--nv", help="Give the build's %test the host's GPUs, so `hpctrain doctor "
                                     "--strict` also checks CUDA-aware MPI on a GPU.")] = False,
) -> None:
    """Build an image with apptainer (or singularity), showing its progress; run it from the hpctrain source tree.

    Example: hpctrain container build containers/hpctrain-hybrid.def -o hpctrain.sif --fakeroot
    """
    from ..tools.containers_build import build as run_build

    image = output if output is not None else Path(definition.stem + ".sif")
    run_build(definition, image, fakeroot=fakeroot, force=force, nv=nv)
