"""What the submission, the supervisor and the status share: the job folder's files, running a Slurm command,
and what Slurm still knows of a job.

The job folder holds, per job: the record (JOBID_hpctrain.jsonl, one JSON event a line, appended by the
supervisor and the rank wrappers), the submission's note (JOBID_hpctrain.json, written by `submit`), and every
rank's logs (JOBID_RANK_log.out/.err). An element of a job array (a sweep) is named JOBID_TASK (its array's
job id and its index), as Slurm names it: its record and logs are JOBID_TASK_hpctrain.jsonl and
JOBID_TASK_RANK_log.out/.err; the array's note, JOBID_hpctrain.json, lists its elements.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from ...base.errors import ConfigError, SubmissionError
from ...base.rankenv import RankEnv


def job_key(env: RankEnv) -> str:
    """The name of this job's files: its job id, or JOBID_TASK in an element of a job array ("local" outside
    Slurm)."""
    if env.array_job_id and env.array_task_id is not None:
        return f"{env.array_job_id}_{env.array_task_id}"
    return env.job_id or "local"


def log_pattern(folder: Path, array: bool) -> str:
    """srun's --output/--error file pattern of every rank's log (%t: the rank), the name `log_path` gives."""
    return f"{folder}/%A_%a_%t_log" if array else f"{folder}/%j_%t_log"


def record_path(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_hpctrain.jsonl"


def meta_path(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_hpctrain.json"


def read_meta(folder: Path, job_id: str) -> dict[str, Any]:
    """The submission's note of a job, or of the array an element JOBID_TASK belongs to ({} if none)."""
    path = meta_path(folder, str(job_id).split("_")[0])
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def log_path(folder: Path, job_id: str, rank: int = 0, stream: str = "err") -> Path:
    """Rank `rank`'s stdout (`out`) or stderr (`err`) log of a job."""
    return Path(folder) / f"{job_id}_{rank}_log.{stream}"


def record(folder: Path, job_id: str, event: str, **fields: Any) -> None:
    """Append one event to the job's record (one JSON object a line; appends of one line are atomic)."""
    line = json.dumps({"time": time.time(), "event": event, **fields}) + "\n"
    with open(record_path(folder, job_id), "a") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def read_record(folder: Path, job_id: str) -> list[dict[str, Any]]:
    path = record_path(folder, job_id)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed writer
            continue
    return events


def check_job_id(job_id: str) -> str:
    job_id = str(job_id).strip()
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise ConfigError(f"job id {job_id!r} is not a Slurm job id: use the number `hpctrain submit` printed "
                          "(see `hpctrain jobs`)")
    return job_id


def run_slurm(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a Slurm command, its output captured; a command that does not answer in time exits 124."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"`{' '.join(argv)}` did not answer in {timeout:g} s "
                                           "(is slurmctld up? `scontrol ping`)")
    except FileNotFoundError:
        raise SubmissionError(
            f"`{argv[0]}` not found: this machine has no Slurm client. Run on a login node, start the local "
            "cluster with `make slurm-up` (slurm/cluster.sh up), or look at the script with --dry-run") from None


def parse_duration(text: str) -> int | None:
    """Seconds in Slurm's [days-]hh:mm:ss / mm:ss / ss; None for UNLIMITED, INVALID, NOT_SET."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(?:(\d+):)?(\d+)", text)
    if not m:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b) if x is not None] + [int(c)]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, mi, s = parts
    return int(days or 0) * 86400 + h * 3600 + mi * 60 + s


def slurm_jobs(job_id: str) -> list[dict[str, str]]:
    """What Slurm still knows about a job (`scontrol show job -o`): one dict per line (an array has one per
    element that started, and one for those still pending), [] once it has forgotten it."""
    try:
        # a controller that is down makes scontrol retry for a minute: the record alone tells then
        proc = run_slurm(["scontrol", "show", "job", "-o", str(job_id)], timeout=10)
    except SubmissionError:  # no Slurm client here
        return []
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return []
    jobs = []
    for line in proc.stdout.strip().splitlines():
        info: dict[str, str] = {}
        for token in shlex.split(line):
            key, eq, value = token.partition("=")
            if eq and key not in info:
                info[key] = value
        jobs.append(info)
    return jobs


def slurm_job(job_id: str) -> dict[str, str] | None:
    """What Slurm still knows about a job or one element of an array, or None once it has forgotten it."""
    jobs = slurm_jobs(job_id)
    return jobs[0] if jobs else None


def array_tasks(text: str) -> list[int]:
    """The indices in Slurm's ArrayTaskId: `3`, `2-5%2`, `0,4-6`."""
    tasks: list[int] = []
    for part in text.split("%")[0].split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            tasks += range(int(first), int(last or first) + 1)
    return tasks
