"""Apptainer recipes for hpctrain: the image config and the recipe renderer. The only module that imports hpccm.

`render_recipe(cfg)` turns a `ContainerConfig` into an Apptainer definition file, using NVIDIA's HPC Container
Maker (hpccm) as a library. It is a pure function: no I/O, same text for the same config (golden files and the
checked-in `containers/*.def` pin it). Two modes:

- **hybrid** (default): the image carries its own CUDA-aware MPI stack (gdrcopy, UCX with CUDA, gdrcopy and
  multi-threading, PMIx, Open MPI 5 built with CUDA, UCX and that PMIx) and mpi4py compiled against it. Slurm
  starts the ranks with `srun --mpi=pmix`; the host's PMIx server talks to the image's PMIx client (PMIx is
  wire-compatible across versions), so the host MPI is never used.
- **bind**: for sites whose MPI must come from the host (Cray MPICH, a vendor Open MPI tuned for the fabric).
  The image carries only an ABI placeholder MPI, so mpi4py can be compiled, and puts `/opt/host-mpi/lib` first
  on `LD_LIBRARY_PATH`: bind the host's MPI libraries there and mpi4py loads them instead.

`write_defaults(DIR)` renders the default recipes checked in under `containers/` (`hpctrain container recipe
--write-defaults containers`). Building an image is `containers_build`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from .. import __version__
from ..base.errors import ConfigError, HpctrainError, one_of

MODES = ("hybrid", "bind")
MPI_ABIS = ("openmpi", "mpich")
UBUNTU = "22.04"
"""The distribution of every image (the CUDA images' Ubuntu 22.04, Python 3.10)."""

# Where things live in the image.
GDRCOPY_PREFIX = "/usr/local/gdrcopy"
UCX_PREFIX = "/usr/local/ucx"
PMIX_PREFIX = "/usr/local/pmix"
OMPI_PREFIX = "/usr/local/openmpi"
PLACEHOLDER_MPI_PREFIX = "/opt/mpi"
HOST_MPI_DIR = "/opt/host-mpi"
VENV = "/opt/venv"
SRC = "/opt/hpctrain/src"
HOST_FILES = ("pyproject.toml", "README.md", "hpctrain")
"""What the image copies from the build directory (the hpctrain source tree) to install hpctrain."""

# Default recipes kept in containers/ (name -> options that differ from the defaults).
DEFAULT_RECIPES: dict[str, dict[str, str]] = {
    "hpctrain-hybrid.def": {},
    "hpctrain-bind.def": {"mode": "bind"},
    "hpctrain-bind-mpich.def": {"mode": "bind", "mpi_abi": "mpich"},
}

_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_CUDA = re.compile(r"^(1[2-9])\.(\d+)\.(\d+)$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@dataclass(kw_only=True, slots=True)
class ContainerConfig:
    """What `hpctrain container recipe` renders: the image's mode and every pinned component version."""

    mode: str = "hybrid"
    """hybrid (the image's own CUDA-aware Open MPI, started by `srun --mpi=pmix`) or bind (the host's MPI is
    bind-mounted over an ABI placeholder at run time)."""
    mpi_abi: str = "openmpi"
    """The MPI ABI mpi4py is compiled against: openmpi (libmpi.so.40) or, in bind mode only, mpich
    (libmpi.so.12: Cray MPICH, MVAPICH, Intel MPI)."""
    cuda: str = "12.9.1"
    """CUDA version of the `nvidia/cuda:<cuda>-{devel,base}-ubuntu22.04` base images (a full X.Y.Z tag)."""
    devel_digest: str | None = None
    """Optional `sha256:...` digest pinning the devel (build-stage) base image beyond its tag."""
    runtime_digest: str | None = None
    """Optional `sha256:...` digest pinning the runtime (final-stage) base image beyond its tag."""
    openmpi: str = "5.0.10"
    """Open MPI version: built with CUDA, UCX and PMIx in hybrid mode (5.0 or newer), the ABI placeholder in
    bind mode (match the host's major version)."""
    ucx: str = "1.20.1"
    """UCX version (hybrid): built with CUDA, gdrcopy, verbs/rdmacm and --enable-mt (MPI_THREAD_MULTIPLE)."""
    pmix: str = "5.0.8"
    """OpenPMIx version (hybrid): the client that Slurm's `--mpi=pmix` server talks to."""
    gdrcopy: str = "2.5.1"
    """gdrcopy version (hybrid): the user-space library UCX uses for low-latency GPU copies."""
    mpich: str = "4.3.2"
    """MPICH version of the ABI placeholder when mpi_abi is mpich."""
    mpi4py: str = "4.1.2"
    """mpi4py version, compiled from source against the image's MPI (never the PyPI wheel)."""
    torch: str = "2.13.0"
    """PyTorch version, installed from the PyTorch wheel index that matches `cuda`."""
    torch_index: str | None = None
    """The pip index for torch; None means https://download.pytorch.org/whl/cuXY for CUDA X.Y."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise one_of("--mode", self.mode, MODES)
        if self.mpi_abi not in MPI_ABIS:
            raise one_of("--mpi-abi", self.mpi_abi, MPI_ABIS)
        if self.mode == "hybrid" and self.mpi_abi != "openmpi":
            raise ConfigError(
                f"--mpi-abi {self.mpi_abi} needs --mode bind: a hybrid image carries its own CUDA-aware Open MPI "
                "(use --mode bind --mpi-abi mpich to run on the host's MPICH-ABI MPI)"
            )
        if not _CUDA.match(str(self.cuda)):
            raise ConfigError(
                f"--cuda {self.cuda!r} must be a full nvidia/cuda image version of CUDA 12 or newer, e.g. --cuda 12.9.1"
            )
        for name in ("openmpi", "ucx", "pmix", "gdrcopy", "mpich", "mpi4py", "torch"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _VERSION.match(value):
                default = _FIELD_DEFAULTS[name]
                raise ConfigError(f"--{name} {value!r} is not a release version like {default}: write e.g. "
                                  f"--{name} {default}")
        if _major_minor(self.openmpi) < (4, 1):
            raise ConfigError(f"--openmpi {self.openmpi} is too old: use 4.1 or newer, e.g. --openmpi 5.0.10")
        if self.mode == "hybrid" and _major_minor(self.openmpi) < (5, 0):
            raise ConfigError(
                f"--openmpi {self.openmpi}: a hybrid image needs Open MPI 5.0 or newer (external PMIx, CUDA through "
                "the accelerator framework), e.g. --openmpi 5.0.10; for a host Open MPI 4.1 use --mode bind"
            )
        if self.mode == "hybrid" and _major_minor(self.pmix) < (4, 2):
            raise ConfigError(f"--pmix {self.pmix}: Open MPI 5 needs PMIx 4.2 or newer, e.g. --pmix 5.0.8")
        if self.mode == "hybrid" and _major_minor(self.ucx) < (1, 15):
            raise ConfigError(f"--ucx {self.ucx} is too old for CUDA 12 and Open MPI 5: use e.g. --ucx 1.20.1")
        for name in ("devel_digest", "runtime_digest"):
            value = getattr(self, name)
            if value is not None and not _DIGEST.match(value):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag} {value!r} must look like sha256:<64 hex digits> (see `docker buildx imagetools "
                    f"inspect nvidia/cuda:{self.cuda}-devel-ubuntu{UBUNTU}`), or leave it out to pin by tag only"
                )
        if self.torch_index is not None and not str(self.torch_index).startswith(("https://", "http://", "file:")):
            raise ConfigError(f"--torch-index {self.torch_index!r} must be a URL, e.g. "
                              f"https://download.pytorch.org/whl/{self.cuda_tag}")

    @property
    def cuda_tag(self) -> str:
        """The PyTorch wheel tag for this CUDA version, e.g. cu129."""
        major, minor, _ = self.cuda.split(".")
        return f"cu{major}{minor}"

    @property
    def torch_index_url(self) -> str:
        return self.torch_index or f"https://download.pytorch.org/whl/{self.cuda_tag}"

    def image(self, flavor: str) -> str:
        """The base image reference of one stage (flavor devel or base), with its digest when pinned."""
        ref = f"nvidia/cuda:{self.cuda}-{flavor}-ubuntu{UBUNTU}"
        digest = self.devel_digest if flavor == "devel" else self.runtime_digest
        return f"{ref}@{digest}" if digest else ref

    def command_line(self) -> str:
        """The `hpctrain container recipe` command that renders this config (flags that differ from the defaults)."""
        parts = ["hpctrain container recipe"]
        for f in fields(self):
            value = getattr(self, f.name)
            if value != _FIELD_DEFAULTS[f.name]:
                parts.append(f"--{f.name.replace('_', '-')} {value}")
        return " ".join(parts)

    def versions(self) -> dict[str, str]:
        """Every component version this image pins (what %labels records)."""
        out = {"hpctrain": __version__, "cuda": self.cuda, "ubuntu": UBUNTU, "mode": self.mode,
               "mpi-abi": self.mpi_abi}
        if self.mode == "hybrid":
            out.update(gdrcopy=self.gdrcopy, ucx=self.ucx, pmix=self.pmix, openmpi=self.openmpi)
        elif self.mpi_abi == "openmpi":
            out["openmpi-placeholder"] = self.openmpi
        else:
            out["mpich-placeholder"] = self.mpich
        out.update(mpi4py=self.mpi4py, torch=self.torch, **{"torch-index": self.torch_index_url})
        out["hpccm"] = _hpccm_version()
        return out


_FIELD_DEFAULTS = {f.name: f.default for f in fields(ContainerConfig)}


def _hpccm_version() -> str:
    try:
        from hpccm.version import __version__ as version
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise HpctrainError(f"rendering a recipe needs hpccm ({exc}): pip install 'hpccm==26.5.0'") from exc
    return version


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------

# Build tools and headers for the devel stage (compilers come with the CUDA devel image; listed for clarity).
_DEVEL_PACKAGES = [
    "bzip2", "ca-certificates", "file", "g++", "gcc", "libevent-dev", "libhwloc-dev", "libibverbs-dev",
    "libnuma-dev", "librdmacm-dev", "make", "perl", "pkg-config", "python3", "python3-dev", "python3-venv",
    "tar", "wget", "zlib1g-dev",
]
# Shared libraries of the runtime stage: what the devel stage's builds link, and what a bound host MPI usually
# needs from the image (verbs, rdmacm, hwloc, libevent).
_RUNTIME_PACKAGES = [
    "ibverbs-providers", "libevent-2.1-7", "libevent-pthreads-2.1-7", "libhwloc15", "libibverbs1", "libnuma1",
    "librdmacm1", "openssh-client", "python3", "zlib1g",
]

# Environment of the final image, and why each setting matters in a container.
_ENV_COMMON = {
    "PYTHONNOUSERSITE": "1",  # $HOME is bind-mounted: never let ~/.local shadow the image's mpi4py or torch
    "HDF5_USE_FILE_LOCKING": "FALSE",  # shards are written once, then only read; Lustre/NFS may lack flock
    "LC_ALL": "C.UTF-8",
}
_ENV_HYBRID = {
    "OMPI_MCA_pml": "ucx",  # the UCX PML is the CUDA-aware point-to-point path
    "OMPI_MCA_osc": "ucx",
    "UCX_MEMTYPE_CACHE": "n",  # memtype cache misclassifies cudaMallocAsync memory
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # the host's UCX_* settings leak into the container
    "PMIX_MCA_gds": "hash",  # the shared-memory store is not shared with a host PMIx server of another version
    "PMIX_MCA_psec": "native",  # no munge inside the image
}


def render_recipe(cfg: ContainerConfig) -> str:
    """The Apptainer definition file for `cfg` (pure: the same config always renders the same text)."""
    hpccm_version = _hpccm_version()  # a one-line error when hpccm is missing
    import hpccm

    saved = (hpccm.config.g_ctype, hpccm.config.g_singularity_version, hpccm.config.g_linux_distro,
             hpccm.config.g_linux_version, hpccm.config.g_cpu_arch)
    try:
        hpccm.config.set_container_format("singularity")
        hpccm.config.set_singularity_version("3.2")  # multi-stage definitions (Apptainer has them all)
        devel = _devel_stage(cfg)
        runtime = _runtime_stage(cfg)
        body = f"{devel}\n\n{runtime}\n"
    finally:
        (hpccm.config.g_ctype, hpccm.config.g_singularity_version, hpccm.config.g_linux_distro,
         hpccm.config.g_linux_version, hpccm.config.g_cpu_arch) = saved
    header = (
        f"# hpctrain {cfg.mode} image ({cfg.mpi_abi} ABI): CUDA {cfg.cuda}, torch {cfg.torch}, mpi4py {cfg.mpi4py}.\n"
        f"# Generated by `{cfg.command_line()}` (hpctrain {__version__}, hpccm {hpccm_version}).\n"
        "# Do not edit: change the options and render again. Build it from the hpctrain source tree:\n"
        "#   hpctrain container build THIS.def -o hpctrain.sif\n"
    )
    return header + body


def _devel_stage(cfg: ContainerConfig) -> str:
    import hpccm
    from hpccm.building_blocks import gdrcopy, mpich, openmpi, packages, pmix, ucx
    from hpccm.primitives import baseimage, comment, copy, shell

    stage = hpccm.Stage(name="devel")
    stage += baseimage(image=cfg.image("devel"), _as="devel", _distro=f"ubuntu{UBUNTU.split('.')[0]}")
    stage += comment("Build tools, headers, and the Python that the runtime stage shares", reformat=False)
    stage += packages(ospackages=_DEVEL_PACKAGES)
    if cfg.mode == "hybrid":
        stage += gdrcopy(version=cfg.gdrcopy, prefix=GDRCOPY_PREFIX, ldconfig=True)
        stage += ucx(version=cfg.ucx, prefix=UCX_PREFIX, cuda="/usr/local/cuda", gdrcopy=GDRCOPY_PREFIX, ofed=True,
                     knem=False, xpmem=False, enable_mt=True, ldconfig=True,
                     ospackages=["binutils-dev", "file", "libnuma-dev", "make", "wget"])
        stage += pmix(version=cfg.pmix, prefix=PMIX_PREFIX, ldconfig=True,
                      ospackages=["file", "libevent-dev", "libhwloc-dev", "make", "tar", "wget"])
        stage += openmpi(
            version=cfg.openmpi, prefix=OMPI_PREFIX, ldconfig=True, infiniband=False,
            url=_openmpi_url(cfg.openmpi),
            cuda="/usr/local/cuda", with_cuda_libdir="/usr/local/cuda/lib64/stubs",
            ucx=UCX_PREFIX, pmix=PMIX_PREFIX, with_libevent="external", with_hwloc="external",
            with_prrte="internal", disable_mpi_fortran=True, disable_oshmem=True,
            configure_opts=["--disable-getpwuid", "--enable-prte-prefix-by-default"],
        )
        mpicc = f"{OMPI_PREFIX}/bin/mpicc"
    elif cfg.mpi_abi == "openmpi":
        stage += comment(f"ABI placeholder: mpi4py links libmpi.so.40 of this Open MPI; at run time the host's\n"
                         f"Open MPI {cfg.openmpi.split('.')[0]}.x, bound into {HOST_MPI_DIR}/lib, replaces it",
                         reformat=False)
        stage += openmpi(
            version=cfg.openmpi, prefix=PLACEHOLDER_MPI_PREFIX, ldconfig=True, infiniband=False, cuda=False,
            url=_openmpi_url(cfg.openmpi), disable_mpi_fortran=True, disable_oshmem=True,
            configure_opts=["--disable-getpwuid", _prefix_by_default(cfg.openmpi)],
        )
        mpicc = f"{PLACEHOLDER_MPI_PREFIX}/bin/mpicc"
    else:
        stage += comment(f"ABI placeholder: mpi4py links libmpi.so.12 (the MPICH ABI) of this MPICH; at run time\n"
                         f"the host's Cray MPICH, MVAPICH or Intel MPI, bound into {HOST_MPI_DIR}/lib, replaces it",
                         reformat=False)
        stage += mpich(version=cfg.mpich, prefix=PLACEHOLDER_MPI_PREFIX, ldconfig=True,
                       configure_opts=["--disable-fortran", "--with-device=ch4:ofi", "--with-libfabric=embedded"])
        mpicc = f"{PLACEHOLDER_MPI_PREFIX}/bin/mpicc"
    stage += comment("hpctrain's source tree, copied from the build directory", reformat=False)
    stage += copy(files={name: f"{SRC}/{name}" for name in HOST_FILES})
    stage += comment(f"Python: mpi4py compiled against the image's MPI, torch for CUDA {cfg.cuda}, hpctrain",
                     reformat=False)
    stage += shell(commands=[
        f"python3 -m venv {VENV}",
        f"{VENV}/bin/python -m pip install --no-cache-dir --upgrade pip==26.3",
        f"MPI4PY_BUILD_MPICC={mpicc} {VENV}/bin/python -m pip install --no-cache-dir --no-binary mpi4py "
        f"mpi4py=={cfg.mpi4py}",
        f"{VENV}/bin/python -m pip install --no-cache-dir torch=={cfg.torch} --index-url {cfg.torch_index_url}",
        f"{VENV}/bin/python -m pip install --no-cache-dir {SRC}",
        f"{VENV}/bin/python -m pip freeze > /opt/hpctrain/pip-freeze.txt",
    ])
    return str(stage)


def _runtime_stage(cfg: ContainerConfig) -> str:
    import hpccm
    from hpccm.primitives import baseimage, comment, copy, environment, label, runscript, shell

    stage = hpccm.Stage(name="runtime")
    stage += baseimage(image=cfg.image("base"), _as="runtime", _distro=f"ubuntu{UBUNTU.split('.')[0]}")
    hybrid = cfg.mode == "hybrid"
    stage += comment("Runtime: the CUDA base image (the driver comes from the host with --nv),\n"
                     "the MPI stack and the Python environment built in the devel stage", reformat=False)
    prefixes = [GDRCOPY_PREFIX, UCX_PREFIX, PMIX_PREFIX, OMPI_PREFIX] if hybrid else [PLACEHOLDER_MPI_PREFIX]
    for prefix in [*prefixes, VENV, "/opt/hpctrain"]:
        stage += copy(_from="devel", src=prefix, dest=prefix)
    libdirs = [f"{p}/lib" for p in prefixes]
    stage += shell(commands=[
        "apt-get update -y",
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends " + " ".join(_RUNTIME_PACKAGES),
        "rm -rf /var/lib/apt/lists/*",
        f"printf '%s\\n' {' '.join(libdirs)} > /etc/ld.so.conf.d/hpctrain.conf",
        "ldconfig",
        *([] if hybrid else [f"mkdir -p {HOST_MPI_DIR}/lib {HOST_MPI_DIR}/deps"]),
    ])
    path = [f"{VENV}/bin", *(f"{p}/bin" for p in ([OMPI_PREFIX, UCX_PREFIX, PMIX_PREFIX] if hybrid
                                                   else [PLACEHOLDER_MPI_PREFIX]))]
    env = {"PATH": ":".join(path) + ":$PATH", **_ENV_COMMON}
    if hybrid:
        env.update(_ENV_HYBRID)
    else:
        # The host's MPI (and its dependencies) win over the placeholder when bound here.
        env["LD_LIBRARY_PATH"] = f"{HOST_MPI_DIR}/lib:{HOST_MPI_DIR}/deps${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
        if cfg.mpi_abi == "openmpi":
            env["PMIX_MCA_gds"] = _ENV_HYBRID["PMIX_MCA_gds"]
            env["PMIX_MCA_psec"] = _ENV_HYBRID["PMIX_MCA_psec"]
    stage += environment(variables=env, _export=False)
    stage += label(metadata={f"org.hpctrain.{key}": value for key, value in cfg.versions().items()})
    stage += runscript(commands=["hpctrain"])
    stage += shell(_test=True, chdir=False, commands=_test_commands(cfg))
    stage += _help(cfg)
    return str(stage)


def _test_commands(cfg: ContainerConfig) -> list[str]:
    """%test: prove that the MPI stack, mpi4py and torch work together (runs at the end of every build)."""
    commands = []
    if cfg.mode == "hybrid":
        commands += [
            "ompi_info --parsable --all | grep -q 'mpi_built_with_cuda_support:value:true'",
            "ucx_info -v | grep -q -- '--with-cuda'",
            "python -c 'from mpi4py import MPI; v = MPI.Get_library_version(); "
            f"assert \"Open MPI v{cfg.openmpi}\" in v, v'",
        ]
    else:
        # The placeholder at build time, the host's library when bound: only the ABI family is known.
        want = "Open MPI" if cfg.mpi_abi == "openmpi" else "MPICH"
        commands.append(f"python -c 'from mpi4py import MPI; v = MPI.Get_library_version(); assert \"{want}\" in v, v'")
    commands += [
        f"python -c 'import torch; assert torch.__version__.startswith(\"{cfg.torch}\"), torch.__version__; "
        f"assert torch.version.cuda, \"torch is a CPU-only build\"'",
        "hpctrain doctor --strict",
    ]
    return commands


def _help(cfg: ContainerConfig):
    from hpccm.primitives import raw

    if cfg.mode == "hybrid":
        lines = [
            f"hpctrain {__version__} with its own CUDA-aware Open MPI {cfg.openmpi} (UCX {cfg.ucx}, PMIx {cfg.pmix}).",
            "Run under Slurm (PMIx connects the host's srun to the MPI in this image):",
            "  srun --mpi=pmix apptainer exec --nv hpctrain.sif hpctrain train --data DATA --run-dir RUN",
            "Check a node first: srun --mpi=pmix -n 2 apptainer exec --nv hpctrain.sif hpctrain doctor",
        ]
    else:
        abi = ("Open MPI " + cfg.openmpi.split(".")[0] + ".x (libmpi.so.40)" if cfg.mpi_abi == "openmpi"
               else "the MPICH ABI (libmpi.so.12): Cray MPICH, MVAPICH, Intel MPI")
        lines = [
            f"hpctrain {__version__} for the host's MPI: mpi4py is compiled against {abi}.",
            f"Bind the host MPI's lib directory to {HOST_MPI_DIR}/lib and the libraries it needs to "
            f"{HOST_MPI_DIR}/deps, e.g.",
            f"  srun apptainer exec --nv --bind /path/to/host/mpi/lib:{HOST_MPI_DIR}/lib hpctrain.sif hpctrain doctor",
            "Without those binds the placeholder MPI in this image runs jobs on one node only.",
        ]
    return raw(singularity="%help\n" + "\n".join(f"    {line}" for line in lines))


def _openmpi_url(version: str) -> str:
    major, minor = _major_minor(version)
    return f"https://download.open-mpi.org/release/open-mpi/v{major}.{minor}/openmpi-{version}.tar.bz2"


def _prefix_by_default(version: str) -> str:
    return "--enable-prte-prefix-by-default" if _major_minor(version) >= (5, 0) else "--enable-orterun-prefix-by-default"


def default_recipes() -> dict[str, str]:
    """The checked-in recipes under containers/: file name -> rendered text."""
    return {name: render_recipe(ContainerConfig(**options)) for name, options in DEFAULT_RECIPES.items()}


def write_defaults(directory: Path) -> list[Path]:
    """Render the default recipes into `directory` (what `containers/` holds)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in default_recipes().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
