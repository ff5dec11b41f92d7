"""`--cpus-per-task auto`: the partition's CPUs per node, read from `sinfo`, shared among the ranks of a node.

`resolve_cpus(cfg, table)` is pure: it takes sinfo's answer as text. `with_cpus(cfg)` asks sinfo and resolves.
The batch script is rendered only from a resolved config (`render` refuses `auto`), so `--dry-run` shows the
number the job will get.

A rank gets the node's CPUs divided by the ranks per node; with GPUs, by the node's GPUs when it has more
than the job uses, so that a job on part of a GPU node takes its GPUs' share of the CPUs and leaves the rest
for the jobs on the other GPUs. Where the partition has nodes of several shapes, the smallest share counts
(the job must fit on any of them).
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from ...base.errors import ConfigError, SubmissionError
from .config import SubmitConfig
from .core import run_slurm

SINFO_FORMAT = "%P %c %G"  # partition (the default one marked *), CPUs per node, generic resources
_FIX = "pass a number instead, e.g. --cpus-per-task 8"


def sinfo_argv(partition: str | None) -> list[str]:
    """The sinfo command that lists the node shapes of PARTITION (all partitions when None)."""
    argv = ["sinfo", "-h", "-o", SINFO_FORMAT]
    return [*argv, "-p", partition] if partition else argv


def gpu_count(gres: str) -> int:
    """GPUs per node in sinfo's GRES column: `gpu:4`, `gpu:a100:4(S:0-1)`, `gpu:2,shard:8`; 0 for `(null)`."""
    return sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def node_shapes(table: str, partition: str | None) -> list[tuple[int, int]]:
    """(CPUs, GPUs) of each node shape of PARTITION (None: the default partition, marked *) in sinfo's output
    TABLE (`sinfo -h -o "%P %c %G"` lines)."""
    rows = []
    for line in table.splitlines():
        words = line.split()
        cpus = re.match(r"\d+", words[1]) if len(words) >= 2 else None
        if cpus:
            rows.append((words[0], int(cpus.group()), gpu_count(words[2] if len(words) > 2 else "")))
    if partition is not None:
        return [(c, g) for name, c, g in rows if name.rstrip("*") == partition]
    default = [(c, g) for name, c, g in rows if name.endswith("*")]
    return default or [(c, g) for _, c, g in rows]


def check_gpus(cfg: SubmitConfig, shapes: list[tuple[int, int]]) -> None:
    """Refuse `--gpus G` when no node of the partition has G GPUs (sinfo's GRES), before anything is submitted:
    Slurm would otherwise hold the job pending forever, or `--dry-run` show a script that cannot run."""
    if not cfg.gpus or not shapes:
        return
    most = max(gpus for _, gpus in shapes)
    if most < cfg.gpus:
        where = f"partition {cfg.partition!r}" if cfg.partition else "the default partition"
        have = f"at most {most} GPUs per node" if most else "no GPUs"
        raise ConfigError(f"--gpus {cfg.gpus}: the nodes of {where} have {have} (sinfo's GRES column): ask for "
                          f"{'at most ' + str(most) if most else 'none'}, or choose a --partition with GPU nodes")


def resolve_cpus(cfg: SubmitConfig, table: str) -> SubmitConfig:
    """CFG with `--cpus-per-task auto` replaced by the CPUs each rank gets on the partition's nodes, as sinfo's
    output TABLE describes them (pure; CFG itself when it has a number already)."""
    if cfg.cpus_per_task != "auto":
        return cfg
    shapes = node_shapes(table, cfg.partition)
    if not shapes:
        where = f"partition {cfg.partition!r}" if cfg.partition else "the default partition"
        raise ConfigError(f"--cpus-per-task auto: sinfo lists no nodes of {where} (see `sinfo -s`): check "
                          f"--partition, or {_FIX}")
    check_gpus(cfg, shapes)
    tasks = int(cfg.tasks_per_node or 1)
    cpus = min(node_cpus // max(tasks, node_gpus if cfg.gpus else 1) for node_cpus, node_gpus in shapes)
    return dataclasses.replace(cfg, cpus_per_task=max(1, cpus))


def with_cpus(cfg: SubmitConfig) -> SubmitConfig:
    """CFG with `--cpus-per-task auto` resolved from the partition's nodes (asks `sinfo`); raises ConfigError,
    saying to pass a number, where sinfo cannot answer (no Slurm on this host, the controller down)."""
    argv = sinfo_argv(cfg.partition)
    if cfg.cpus_per_task != "auto":  # a number needs no sinfo; where sinfo answers, the GPUs are checked
        if cfg.gpus:
            try:
                proc = run_slurm(argv, timeout=30)
            except SubmissionError:
                return cfg
            if proc.returncode == 0:
                check_gpus(cfg, node_shapes(proc.stdout, cfg.partition))
        return cfg
    try:
        proc = run_slurm(argv, timeout=30)
    except SubmissionError:
        raise ConfigError("--cpus-per-task auto reads the partition's CPUs per node from `sinfo`, which this "
                          f"machine does not have (no Slurm client here): {_FIX}") from None
    if proc.returncode != 0:
        why = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
        raise ConfigError(f"--cpus-per-task auto: `{shlex.join(argv)}` failed ({why}): {_FIX}")
    return resolve_cpus(cfg, proc.stdout)
