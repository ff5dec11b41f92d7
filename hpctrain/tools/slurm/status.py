"""A job's state, from its record and what Slurm still knows: `job_status`, `list_jobs`, `wait`, `exit_code`.

The supervisor's record (FOLDER/JOBID_hpctrain.jsonl) tells what Slurm cannot: sacct needs slurmdbd, which many
clusters (and the local one) lack, and Slurm forgets a finished job after MinJobAge.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from ...base.errors import SubmissionError
from .core import check_job_id, log_path, meta_path, read_record, slurm_job

FINAL_STATES = ("completed", "failed", "cancelled", "timed_out", "preempted", "unknown")
_PENDING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
_RUNNING = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING")
_SLURM_FINAL = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timed_out",
                "PREEMPTED": "preempted", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed",
                "DEADLINE": "timed_out"}


def job_status(folder: Path, job_id: str) -> dict[str, Any]:
    """The job's state, told apart as pending, running, requeued (why), completed, failed, cancelled,
    timed_out, preempted or unknown, from the job's record and what Slurm still knows."""
    job_id = check_job_id(job_id)
    events = read_record(folder, job_id)
    meta = meta_path(folder, job_id)
    if meta.exists():  # a cluster whose state was wiped reuses job ids: older events are another job's
        submitted = json.loads(meta.read_text()).get("submitted_at", 0)
        events = [e for e in events if e.get("time", 0) >= submitted - 1]
    slurm = slurm_job(job_id)
    slurm_state = (slurm or {}).get("JobState")
    restarts = int((slurm or {}).get("Restarts", 0) or 0)
    # The supervisor's events decide; the ranks' own notes (ranks_stopped, rank_failed) only feed them.
    main = [e for e in events if e.get("event") not in ("ranks_stopped", "rank_failed")]
    last = main[-1] if main else {}
    starts = [e for e in events if e.get("event") == "start"]
    out: dict[str, Any] = {"job_id": job_id, "slurm_state": slurm_state, "restarts": max(restarts, len(starts) - 1, 0),
                           "last_event": last.get("event"), "reason": last.get("reason"),
                           "exit_code": last.get("exit_code"), "events": events}
    if slurm_state in _PENDING:
        if last.get("event") == "requeued" or restarts:
            out.update(state="requeued", reason=last.get("reason") if last.get("event") == "requeued" else "slurm")
        else:
            out["state"] = "pending"
    elif slurm_state in _RUNNING and last.get("event") in (None, "start", "requeued"):
        out["state"] = "running"
    elif last.get("event") == "completed":
        out["state"] = "completed"
    elif last.get("event") == "failed":
        out["state"] = "failed"
    elif last.get("event") == "cancelled" or slurm_state == "CANCELLED":
        out["state"] = "cancelled"
    elif last.get("event") == "requeued" and slurm_state in _SLURM_FINAL:  # the requeued job never restarted
        out["state"] = _SLURM_FINAL[slurm_state]
    elif last.get("event") in ("stopped", "requeued"):
        out["state"] = "timed_out" if last.get("reason") == "timeout" else "preempted"
    elif last.get("event") == "preempted":
        out["state"] = "preempted"
    elif slurm_state in _SLURM_FINAL:
        out["state"] = _SLURM_FINAL[slurm_state]
    elif slurm_state in _RUNNING:
        out["state"] = "running"
    else:
        out["state"] = "unknown"
    if out["exit_code"] is None and slurm and slurm.get("ExitCode") and out["state"] in FINAL_STATES:
        out["exit_code"] = int(slurm["ExitCode"].split(":")[0])
    return out


def list_jobs(folder: Path) -> list[dict[str, Any]]:
    """The hpctrain jobs submitted into `folder`, oldest first, each with its state."""
    jobs = []
    for meta in sorted(Path(folder).glob("*_hpctrain.json"), key=lambda p: int(p.name.split("_")[0])):
        info = json.loads(meta.read_text())
        status = job_status(folder, info["job_id"])
        jobs.append({"job_id": info["job_id"], "state": status["state"], "reason": status["reason"],
                     "restarts": status["restarts"], "submitted_at": info.get("submitted_at"),
                     "command": info.get("command")})
    return jobs


def exit_code(status: dict[str, Any]) -> int:
    """The code `--wait` returns for a finished job: 0 completed, the ranks' code on failure, 3 when it stopped
    with a checkpoint and was not requeued, 1 otherwise."""
    if status["state"] == "completed":
        return 0
    code = status.get("exit_code")
    return int(code) if isinstance(code, int) and code else 1


def follow(paths: Sequence[Path], positions: dict[Path, int], stream: TextIO) -> None:
    """Print what was appended to `paths` since the last call."""
    for path in paths:
        try:
            with open(path, "rb") as fh:
                fh.seek(positions.get(path, 0))
                data = fh.read()
                positions[path] = fh.tell()
        except FileNotFoundError:
            continue
        if data:
            stream.write(data.decode(errors="replace"))
            stream.flush()


def wait(folder: Path, job_id: str, *, stream: TextIO | None = None, poll_s: float = 1.0,
         timeout_s: float | None = None) -> dict[str, Any]:
    """Follow rank 0's log until the job has finished (through any requeues); return its final status."""
    job_id = check_job_id(job_id)
    positions: dict[Path, int] = {}
    paths = [log_path(folder, job_id, 0, "err")]
    start = time.monotonic()
    while True:
        status = job_status(folder, job_id)
        if stream is not None:
            follow(paths, positions, stream)
        if status["state"] in FINAL_STATES and status["state"] != "unknown":
            return status
        if status["state"] == "unknown" and status["slurm_state"] is None and not status["events"] and \
                time.monotonic() - start > 30:
            return status
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise SubmissionError(f"job {job_id} still {status['state']} after {timeout_s:.0f} s")
        time.sleep(poll_s)
