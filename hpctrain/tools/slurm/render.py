"""The batch script, rendered without I/O: `render_sbatch(cfg, command) -> str`, pinned by golden files.

It is built by submitit's own sbatch writer (`submitit_private.make_sbatch_string`), so the text `--dry-run`
prints is byte for byte the file that `submission.submit` hands to sbatch. Also the argument lists the script
is made of: the supervisor, the launcher (srun or mpirun), the rank wrapper, and what every rank runs. A sweep
is the same script as a job array: the supervisor of each element is given the sweep file (see `sweep`).
`--cpus-per-task auto` must be resolved first (`cpus.with_cpus`): rendering does no I/O.
"""

from __future__ import annotations

import shlex
import unicodedata
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from ...base.errors import ConfigError
from ..launch import SUBCOMMANDS
from .config import SubmitConfig
from .core import log_pattern
from .submitit_private import make_sbatch_string
from .sweep import sweep_elements, sweep_file

# Slurm signals a rank's processes from their first instruction: the rank wrapper starts with SIGUSR2 blocked
# (pending, not lost, across exec), and unblocks it once its handler is in (GNU env, coreutils >= 8.31; the
# supervisor leaves it out on a node whose env cannot, see `supervise._launchable`).
BLOCK_STOP = ("env", "--block-signal=USR2")
# What a rank runs inside the image: bind the step's PMIx server directory (known only in the task), then
# exec apptainer with the arguments that follow. A constant string; user values only ever arrive as "$@".
CONTAINER_SH = 'exec apptainer exec --nv ${PMIX_SERVER_TMPDIR:+--bind "$PMIX_SERVER_TMPDIR"} "$@"'
# Options of `train` whose values are directories a container must see.
_PATH_OPTIONS = ("--data", "--run-dir")


def rank_command(cfg: SubmitConfig, command: Sequence[str]) -> list[str]:
    """What every rank runs: an hpctrain subcommand through `python -m hpctrain`, or the program itself,
    inside `apptainer exec --nv IMAGE` when a container is given."""
    if not command:
        raise ConfigError("no COMMAND given: write e.g. `hpctrain submit --nodes 2 -- train --data data/ --run-dir runs/a`")
    python = cfg.python if cfg.container is None else cfg.container_python
    argv = [python, "-u", "-m", "hpctrain", *command] if command[0] in SUBCOMMANDS else list(command)
    if cfg.container is None:
        return argv
    # apptainer binds the working directory itself (the job runs where it was submitted), so relative paths
    # need nothing; absolute ones are bound one by one.
    binds = [str(cfg.folder), *(p for p in command_paths(command) if p.startswith("/")), *cfg.binds]
    return ["bash", "-c", CONTAINER_SH, "hpctrain-rank", "--bind", ",".join(dict.fromkeys(binds)),
            str(cfg.container), *argv]


def command_paths(command: Sequence[str]) -> list[str]:
    """The --data and --run-dir directories named in COMMAND (the container must see them)."""
    paths = []
    for i, arg in enumerate(command):
        for opt in _PATH_OPTIONS:
            if arg == opt and i + 1 < len(command):
                paths.append(command[i + 1])
            elif arg.startswith(opt + "="):
                paths.append(arg[len(opt) + 1:])
    return paths


def _launch_parts(cfg: SubmitConfig, command: Sequence[str]) -> list[list[str]]:
    """The launcher (srun or mpirun), the per-rank wrapper, and what each rank runs, as three argument lists.

    Each rank runs under `python -m hpctrain.tools.slurm rank`, which turns the collective stop (exit 3: every rank
    checkpointed together) into exit 0 plus a note in the job record: with --kill-on-bad-exit (and under
    mpirun) the first rank to exit 3 would otherwise kill the others while they are still finishing. It starts
    through `env --block-signal=USR2` (BLOCK_STOP), so a stop that comes while Python starts waits, pending,
    for the wrapper's first line instead of killing the rank.
    """
    if cfg.mpi == "mpirun":
        launcher = ["mpirun", "-n", str(cfg.world_size), "--map-by", f"ppr:{cfg.tasks_per_node}:node",
                    "--bind-to", "none"]
    else:
        # --cpus-per-task again: srun does not take it from the job since Slurm 22.05, and would bind every
        # rank to one CPU where the site binds tasks (while OMP_NUM_THREADS says more).
        logs = log_pattern(cfg.folder, array=bool(cfg.sweep))
        launcher = ["srun", "--unbuffered", "--output", f"{logs}.out", "--error", f"{logs}.err",
                    f"--cpus-per-task={cfg.cpus_per_task}", f"--mpi={cfg.mpi}", "--kill-on-bad-exit=1"]
    wrapper = [*BLOCK_STOP, cfg.python, "-u", "-m", "hpctrain.tools.slurm", "rank", "--folder", str(cfg.folder), "--"]
    return [launcher, wrapper, rank_command(cfg, command)]


def sbatch_parameters(cfg: SubmitConfig, command: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments of submitit's sbatch writer for this job (the valid ones are its parameters)."""
    check_inputs(cfg, command)
    setup = ["export CUDA_DEVICE_ORDER=PCI_BUS_ID", f"export OMP_NUM_THREADS={cfg.cpus_per_task}"]
    setup += [f"export {item.partition('=')[0]}={shlex.quote(item.partition('=')[2])}" for item in cfg.env]
    if cfg.sweep:  # what each element runs, for the reader (the supervisor reads it from the sweep file)
        setup += ["# job array: element N appends its flags to the command"]
        setup += [f"#   {e['task']}: {shlex.join(e['args'])}" for e in sweep_elements(cfg.sweep, command)]
    if cfg.container is not None:
        # apptainer refuses to bind a directory that does not exist yet (a new run directory).
        setup += [shlex.join(["mkdir", "-p", "--", *command_paths(command)])] if command_paths(command) else []
    extra: dict[str, Any] = {"requeue": True}
    if cfg.mpi == "mpirun":
        extra["signal"] = f"B:USR2@{cfg.signal_delay_s}"  # to the supervisor, which hands it to mpirun
    params: dict[str, Any] = dict(
        job_name=cfg.job_name, nodes=cfg.nodes, ntasks_per_node=cfg.tasks_per_node, cpus_per_task=cfg.cpus_per_task,
        time=cfg.time, signal_delay_s=cfg.signal_delay_s, setup=setup, use_srun=False, wckey=None,
        additional_parameters=extra,
    )
    if cfg.gpus:
        params["gpus_per_node"] = cfg.gpus
    if cfg.partition:
        params["partition"] = cfg.partition
    if cfg.account:
        params["account"] = cfg.account
    if cfg.sweep:
        params["array_parallelism"] = cfg.max_parallel or cfg.array_size
    return params


def check_inputs(cfg: SubmitConfig, command: Sequence[str]) -> None:
    """Refuse what cannot be written into the script: an unresolved `auto`, and a control character in any value
    that reaches it. Every text field of the config is checked, not a list of them, so a new one is covered: a
    newline in `--account` would otherwise end its `#SBATCH` line, and sbatch reads the next line, the user's
    text, as a directive of its own; quoting cannot help there, since sbatch reads directives line by line."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, (str, Path)):
                _refuse_control(f"--{f.name.replace('_', '-')}", str(item))
    for i, arg in enumerate(command):
        _refuse_control(f"COMMAND argument {i + 1}", str(arg))
    if not isinstance(cfg.cpus_per_task, int):
        raise ConfigError(f"--cpus-per-task {cfg.cpus_per_task!r} is resolved before the script is written "
                          "(hpctrain.tools.slurm.cpus.with_cpus asks sinfo): pass a number, or resolve it first")


def _refuse_control(what: str, text: str) -> None:
    bad = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ConfigError(f"{what} {text!r} holds a control character ({bad!r}), which would break the batch script "
                          "(a newline starts a line sbatch reads as a directive of its own): remove it")


def batch_command(cfg: SubmitConfig, command: Sequence[str]) -> str:
    """The script's last line: the supervisor replaces the batch shell and starts the ranks."""
    check_inputs(cfg, command)
    supervisor = [cfg.python, "-u", "-m", "hpctrain.tools.slurm", "supervise", "--folder", str(cfg.folder),
                  "--max-requeues", str(cfg.max_requeues), "--signal-delay", str(cfg.signal_delay_s)]
    if cfg.sweep:  # each element appends its combination's flags to COMMAND, read there by its array index
        supervisor += ["--sweep", str(sweep_file(cfg.folder, sweep_elements(cfg.sweep, command)))]
    parts = [[*supervisor, "--"], *_launch_parts(cfg, command)]
    return "exec " + " \\\n    ".join(shlex.join(part) for part in parts)


def render_sbatch(cfg: SubmitConfig, command: Sequence[str]) -> str:
    """The batch script `hpctrain submit` writes for COMMAND (pure: no I/O, the same text every time): one job,
    or with --sweep a job array of one element per combination (`#SBATCH --array=0-N%K`)."""
    return make_sbatch_string(batch_command(cfg, command), cfg.folder, array_size=cfg.array_size or None,
                              **sbatch_parameters(cfg, command))
