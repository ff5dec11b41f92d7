"""The one place that reads the launcher's environment.

SLURM_*, OMPI_*, PMI_*/PMIX_*, CUDA_VISIBLE_DEVICES and TMPDIR are read here, from one table of names, and handed
down as a plain `RankEnv` value. Nothing else in hpctrain looks at these variables.

Two test hooks are read here too, for the tests and benchmarks of the timeline and the flight recorder
(docs/guides/timeline.md); a run without them is untouched:
- HPCTRAIN_TEST_STRAGGLER=RANK:SECONDS: that rank sleeps SECONDS in its data path before every step (a
  straggler of a known size);
- HPCTRAIN_TEST_HANG=RANK:STEP:BUCKET: that rank stops for good just before the collective of gradient
  bucket BUCKET at step STEP, as a rank stuck in its own code would (the others wait for it there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# Each field of RankEnv and the variables that may hold it, first match wins.
_ENV_NAMES: dict[str, tuple[str, ...]] = {
    "rank": ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"),
    "world_size": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
    "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"),
    "local_size": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"),
    "cpus_per_task": ("SLURM_CPUS_PER_TASK",),
    "job_id": ("SLURM_JOB_ID",),
    "array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "node_name": ("SLURMD_NODENAME",),
    "restart_count": ("SLURM_RESTART_COUNT",),
    "cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",),
    "slurm_tmpdir": ("SLURM_TMPDIR",),
    "tmpdir": ("TMPDIR",),
    "test_straggler": ("HPCTRAIN_TEST_STRAGGLER",),
    "test_hang": ("HPCTRAIN_TEST_HANG",),
}

# Variables whose presence says which launcher started this process.
_LAUNCHER_MARKERS = (
    ("mpirun", "OMPI_COMM_WORLD_SIZE"),
    ("srun", "SLURM_STEP_ID"),
    ("pmix", "PMIX_RANK"),
    ("pmi", "PMI_RANK"),
)


@dataclass(frozen=True, slots=True)
class RankEnv:
    """What the launcher told this process about where it runs."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int = 0
    local_size: int = 1
    cpus_per_task: int | None = None
    job_id: str | None = None
    array_job_id: str | None = None  # in an element of a job array: the array's job id, and the element's index
    array_task_id: int | None = None
    node_name: str | None = None
    restart_count: int = 0
    cuda_visible_devices: str | None = None
    slurm_tmpdir: str | None = None  # the job's node-local scratch directory, where a site sets it up
    tmpdir: str | None = None
    test_straggler: str | None = None  # test hooks (see the module's docstring)
    test_hang: str | None = None
    launcher: str = "none"
    cpus_available: int = 1

    @property
    def under_launcher(self) -> bool:
        return self.launcher != "none"

    def torch_threads(self) -> int:
        """Threads this rank should use: the CPUs Slurm gave the task, else its share of this node's CPUs."""
        if self.cpus_per_task:
            return max(1, self.cpus_per_task)
        return max(1, self.cpus_available // max(1, self.local_size))


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return value
    return None


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.split("(")[0].split(",")[0])
    except ValueError:
        return None


def read_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read the launcher environment once (`os.environ` unless given) into a `RankEnv`."""
    environ = os.environ if environ is None else environ
    raw = {field: _first(environ, names) for field, names in _ENV_NAMES.items()}
    launcher = next((name for name, var in _LAUNCHER_MARKERS if var in environ), "none")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return RankEnv(
        rank=_int(raw["rank"]),
        world_size=_int(raw["world_size"]),
        local_rank=_int(raw["local_rank"]) or 0,
        local_size=_int(raw["local_size"]) or 1,
        cpus_per_task=_int(raw["cpus_per_task"]),
        job_id=raw["job_id"],
        array_job_id=raw["array_job_id"],
        array_task_id=_int(raw["array_task_id"]),
        node_name=raw["node_name"],
        restart_count=_int(raw["restart_count"]) or 0,
        cuda_visible_devices=raw["cuda_visible_devices"],
        slurm_tmpdir=raw["slurm_tmpdir"],
        tmpdir=raw["tmpdir"],
        test_straggler=raw["test_straggler"],
        test_hang=raw["test_hang"],
        launcher=launcher,
        cpus_available=cpus,
    )


def select_device(env: RankEnv, visible_gpus: int) -> str:
    """The device this rank uses: one GPU per rank, chosen by local rank among the GPUs it can see.

    Works whether Slurm gives each task only its own GPU (one visible: use it) or every task all of the
    node's GPUs (use the one at the local rank). Raises ConfigError when ranks on a node outnumber the
    GPUs they can see, instead of letting two ranks share a GPU or hang at init.
    """
    from .errors import ConfigError

    if visible_gpus <= 0:
        return "cpu"
    if visible_gpus == 1:
        return "cuda:0"
    if env.local_rank >= visible_gpus or env.local_size > visible_gpus:
        raise ConfigError(
            f"{env.local_size} ranks on node {env.node_name or 'this node'} but only {visible_gpus} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r}): start at most {visible_gpus} tasks per node "
            "(hpctrain submit --gpus G sets tasks per node to G)"
        )
    return f"cuda:{env.local_rank}"
