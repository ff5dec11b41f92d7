"""Building an Apptainer image from a definition: `apptainer build` (or `singularity build`) run with an argument
list, its output streamed with the elapsed time, and a one-line answer saying how to get Apptainer when neither
is installed. The recipes themselves are rendered by `containers`.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from ..base.errors import ConfigError, HpctrainError

BUILDERS = ("apptainer", "singularity")
INSTALL_HELP = (
    "install Apptainer: on a cluster try `module load apptainer`; on Ubuntu `sudo add-apt-repository -y "
    "ppa:apptainer/ppa && sudo apt-get install -y apptainer`; on RHEL/Rocky `sudo dnf install -y epel-release "
    "&& sudo dnf install -y apptainer`; other systems: https://apptainer.org/docs/admin/main/installation.html"
)


def find_builder() -> str:
    """The path of `apptainer`, else `singularity`; ConfigError (exit 2) saying how to get one when neither exists."""
    for name in BUILDERS:
        path = shutil.which(name)
        if path:
            return path
    raise ConfigError(f"neither `apptainer` nor `singularity` is on PATH, so the image cannot be built here: "
                      f"{INSTALL_HELP}")


def build_command(builder: str, definition: Path, image: Path, *, fakeroot: bool = False, force: bool = False,
                  nv: bool = False) -> list[str]:
    """The argument list of one `apptainer build` (a pure function)."""
    argv = [builder, "build"]
    if fakeroot:
        argv.append("--fakeroot")
    if force:
        argv.append("--force")
    if nv:
        argv.append("--nv")
    return [*argv, str(image), str(definition)]


def host_files(definition_text: str) -> list[str]:
    """Relative host paths that a definition's `%files` sections copy from the build directory."""
    out: list[str] = []
    section = None
    for line in definition_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            section = stripped.split()
            continue
        if section == ["%files"] and stripped and not stripped.startswith("#"):
            src = stripped.split()[0]
            if not src.startswith("/"):
                out.append(src)
    return out


def build(definition: Path, image: Path, *, fakeroot: bool = False, force: bool = False, nv: bool = False,
          echo: Callable[[str], None] | None = None) -> Path:
    """Build `image` from `definition` with apptainer (or singularity) in the current directory, echoing each
    line of its output prefixed with the elapsed time. Returns the image path; raises HpctrainError on failure."""
    echo = echo or (lambda line: print(line, flush=True))
    definition = Path(definition)
    image = Path(image)
    if not definition.is_file():
        raise ConfigError(f"definition file {str(definition)!r} does not exist: write one with "
                          "`hpctrain container recipe -o hpctrain.def`")
    if image.suffix != ".sif":
        raise ConfigError(f"-o {str(image)!r} must name a .sif file, e.g. -o hpctrain.sif")
    if image.exists() and not force:
        raise ConfigError(f"{str(image)!r} already exists: pass --force to replace it, or choose another -o")
    missing = [src for src in host_files(definition.read_text()) if not Path(src).exists()]
    if missing:
        raise ConfigError(
            f"{definition} copies {', '.join(repr(m) for m in missing)} from the build directory but "
            f"{Path.cwd()} has no such file: run `hpctrain container build` from the hpctrain source tree"
        )
    builder = find_builder()
    argv = build_command(builder, definition, image, fakeroot=fakeroot, force=force, nv=nv)
    echo(f"[00:00] building {image} from {definition} with {Path(builder).name} "
         "(a hybrid image compiles UCX, PMIx and Open MPI: expect 30-60 minutes)")
    echo(f"[00:00] $ {' '.join(argv)}")
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                errors="replace")
    except OSError as exc:
        raise HpctrainError(f"cannot start {builder}: {exc}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        echo(f"[{_elapsed(time.monotonic() - start)}] {line.rstrip()}")
    code = proc.wait()
    elapsed = _elapsed(time.monotonic() - start)
    if code != 0:
        raise HpctrainError(f"{Path(builder).name} build exited {code} after {elapsed}: the lines above show the "
                            "failing step; fix it and run the same command again")
    if not image.is_file():
        raise HpctrainError(f"{Path(builder).name} build succeeded but {str(image)!r} was not written")
    echo(f"[{elapsed}] built {image}; sign it with `{Path(builder).name} sign {image}`")
    return image


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
