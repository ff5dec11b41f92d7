"""What `hpctrain submit` asks for: `SubmitConfig`, one dataclass, checked in `__post_init__`."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...base.errors import ConfigError, one_of
from .sweep import parse_sweep, sweep_size

MPI_MODES = ("pmix", "pmi2", "mpirun")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(kw_only=True, slots=True)
class SubmitConfig:
    """One `hpctrain submit`: the allocation, how ranks start, and where the job's files go."""

    nodes: int = 1
    """Nodes to allocate."""
    gpus: int = 0
    """GPUs per node; one rank per GPU."""
    tasks_per_node: int | None = None
    """Ranks per node (default: --gpus, or 1 without GPUs)."""
    cpus_per_task: int | str = "auto"
    """CPUs per rank (also OMP_NUM_THREADS and the rank's torch threads): a number, or auto: the partition's
    CPUs per node (from sinfo) divided by the ranks per node (with --gpus: by the node's GPUs, if more)."""
    partition: str | None = None
    """Slurm partition (default: the cluster's)."""
    time: int = 60
    """Time limit in minutes; the job checkpoints and requeues itself before it."""
    account: str | None = None
    """Slurm account to charge."""
    container: Path | None = None
    """An Apptainer/Singularity image: every rank runs in `apptainer exec --nv IMAGE`."""
    folder: Path = Path("hpctrain-jobs")
    """Where the batch script, the logs (JOBID_RANK_log.out/.err) and the job record go."""
    env: tuple[str, ...] = ()  # what the job exports; `hpctrain.base.rankenv` reads what Slurm and MPI give a rank
    """Extra environment of every rank, K=V (repeatable; exported by the batch script)."""
    mpi: str = "pmix"
    """How ranks start: pmix or pmi2 (srun --mpi=...), or mpirun inside the allocation."""
    job_name: str = "hpctrain"
    """The Slurm job name."""
    signal_delay_s: int | None = None
    """Seconds before the time limit at which SIGUSR2 asks for a checkpoint (default: a quarter of the limit, at
    most 90)."""
    max_requeues: int = 10
    """How often the job may requeue itself after a checkpoint (preemption or time limit)."""
    sweep: tuple[str, ...] = ()
    """A train flag and its values, KEY=V1,V2,... (repeatable): the grid of all combinations runs as one job
    array, each element in RUN/KEY=V[_KEY=V...] (RUN: the train command's --run-dir)."""
    max_parallel: int | None = None
    """Elements of a --sweep that may run at once (default: all)."""
    binds: tuple[str, ...] = ()
    """Extra paths to bind into the container (the job folder and the command's --data/--run-dir always are)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The Python that runs hpctrain on the nodes: the job's supervisor, and the ranks unless in a container
    (default: this one)."""
    container_python: str = "python3"
    """The Python inside the container that runs the ranks of an hpctrain subcommand."""

    def __post_init__(self) -> None:
        if isinstance(self.cpus_per_task, str) and self.cpus_per_task != "auto":
            try:
                self.cpus_per_task = int(self.cpus_per_task)
            except ValueError:
                raise ConfigError(f"--cpus-per-task {self.cpus_per_task!r} must be a whole number of at least 1, "
                                  "or auto (the node's CPUs shared among its ranks)") from None
        checked = [("--nodes", self.nodes, 1), ("--gpus", self.gpus, 0), ("--time", self.time, 1),
                   ("--max-requeues", self.max_requeues, 0)]
        checked += [("--cpus-per-task", self.cpus_per_task, 1)] if self.cpus_per_task != "auto" else []
        checked += [("--max-parallel", self.max_parallel, 1)] if self.max_parallel is not None else []
        for name, value, low in checked:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} {value!r} must be a whole number of at least {low}")
        if self.tasks_per_node is None:
            self.tasks_per_node = self.gpus or 1
        if not isinstance(self.tasks_per_node, int) or self.tasks_per_node < 1:
            raise ConfigError(f"--tasks-per-node {self.tasks_per_node!r} must be at least 1")
        if self.gpus and self.tasks_per_node > self.gpus:
            raise ConfigError(
                f"--tasks-per-node {self.tasks_per_node} with --gpus {self.gpus}: every rank needs a GPU of its own, "
                f"so use at most {self.gpus} tasks per node (or ask for --gpus {self.tasks_per_node})")
        if self.mpi not in MPI_MODES:
            raise one_of("--mpi", self.mpi, MPI_MODES)
        if self.signal_delay_s is None:
            self.signal_delay_s = min(90, self.time * 15)
        if not 1 <= self.signal_delay_s < self.time * 60:
            raise ConfigError(f"signal delay {self.signal_delay_s} s must be between 1 s and the time limit "
                              f"(--time {self.time} min): the checkpoint signal comes that long before the end")
        for item in self.env:
            name, eq, _ = item.partition("=")
            if not eq or not _ENV_NAME.match(name):
                raise ConfigError(f"--env {item!r} must be NAME=VALUE with a shell variable name, e.g. --env NCCL_DEBUG=INFO")
        if not self.job_name or any(c.isspace() for c in self.job_name):
            raise ConfigError(f"job name {self.job_name!r} must be one word")
        self.sweep = (self.sweep,) if isinstance(self.sweep, str) else tuple(self.sweep)
        parse_sweep(self.sweep)
        if self.max_parallel is not None and not self.sweep:
            raise ConfigError(f"--max-parallel {self.max_parallel} limits how many elements of a --sweep run at "
                              "once: give a --sweep, or leave --max-parallel out")
        self.folder = Path(self.folder)
        if self.container is not None:
            self.container = Path(self.container)

    @property
    def world_size(self) -> int:
        return self.nodes * int(self.tasks_per_node or 1)

    @property
    def array_size(self) -> int:
        """Elements of the job array a --sweep makes (0: one job, no array)."""
        return sweep_size(self.sweep)
