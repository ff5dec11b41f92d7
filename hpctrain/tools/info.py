"""`hpctrain info`: the versions of what hpctrain runs on and which optional features this install has.

One process, no launcher needed: the MPI library is asked for its version (MPI starts as a singleton). For
what each rank of a job sees, and what is wrong with it, run `hpctrain doctor` under the launcher instead.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import sys
from typing import Any

from .. import __version__
from ..base.rankenv import read_env
from .doctor import hdf5_facts, mpi_facts, short_library, torch_facts

# Optional packages, and what each one enables.
OPTIONAL = (("tokenizers", "BPE tokenizers for text (shard --tokenizer, --train-tokenizer)"),
            ("pyarrow", "Parquet sources (shard FILE.parquet, parquet:PATH)"),
            ("tensorboard", "train --tensorboard"),
            ("submitit", "hpctrain submit (Slurm)"),
            ("hpccm", "hpctrain container recipe"))
PROGRAMS = (("mpirun", "hpctrain launch"), ("sbatch", "hpctrain submit"), ("apptainer", "hpctrain container build"))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> dict[str, Any]:
    """{hpctrain, python, platform, torch, mpi, hdf5, optional: {package: version|None}, programs: {name: path|None}}."""
    return {"hpctrain": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
            "torch": torch_facts(read_env()), "mpi": mpi_facts(), "hdf5": hdf5_facts(),
            "optional": {name: _version(name) for name, _ in OPTIONAL},
            "programs": {name: shutil.which(name) for name, _ in PROGRAMS}}


def format_info(facts: dict[str, Any]) -> str:
    torch, mpi, hdf5 = facts["torch"], facts["mpi"], facts["hdf5"]
    lines = [f"hpctrain {facts['hpctrain']} (Python {facts['python']}, {facts['platform']})"]
    lines.append(f"torch       {torch.get('version', torch.get('error'))}, CUDA {torch.get('cuda') or 'none'}, "
                 f"{torch.get('gpus', 0)} GPU(s) visible")
    if "error" in mpi:
        lines.append(f"MPI         {mpi['error']}")
    else:
        aware = {True: "yes", False: "no", None: "cannot tell"}[mpi["cuda_aware"]]
        lines.append(f"MPI         {short_library(mpi['library'])} (MPI {mpi['mpi_version']}), mpi4py {mpi['mpi4py']}, "
                     f"threads {mpi['thread_level']}, CUDA-aware: {aware}")
    lines.append(f"HDF5        {hdf5.get('hdf5', hdf5.get('error'))}, h5py {hdf5.get('h5py', '-')}")
    for name, what in OPTIONAL:
        version = facts["optional"][name]
        lines.append(f"{name:<12}{version or 'not installed'}: {what}")
    for name, what in PROGRAMS:
        lines.append(f"{name:<12}{facts['programs'][name] or 'not on PATH'}: {what}")
    return "\n".join(lines)
