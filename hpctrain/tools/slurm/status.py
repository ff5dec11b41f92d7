"""A job's state, from its record and what Slurm still knows: `job_status`, `list_jobs`, `wait`, `exit_code`.

The supervisor's record (FOLDER/JOBID_hpctrain.jsonl) tells what Slurm cannot: sacct needs slurmdbd, which many
clusters (and the local one) lack, and Slurm forgets a finished job after MinJobAge. A job array (a sweep) has
one record per element (JOBID_TASK_hpctrain.jsonl); its state is made of theirs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from ...base.errors import SubmissionError
from .core import array_tasks, check_job_id, log_path, read_meta, read_record, slurm_job, slurm_jobs

FINAL_STATES = ("completed", "failed", "cancelled", "timed_out", "preempted", "unknown")
_PENDING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
_RUNNING = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING")
_SLURM_FINAL = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timed_out",
                "PREEMPTED": "preempted", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed",
                "DEADLINE": "timed_out"}


def job_status(folder: Path, job_id: str) -> dict[str, Any]:
    """The job's state, told apart as pending, running, requeued (why), completed, failed, cancelled,
    timed_out, preempted or unknown, from the job's record and what Slurm still knows. JOBID_TASK is one
    element of a job array; the id of an array gives the state of the whole (see `array_status`)."""
    job_id = check_job_id(job_id)
    meta = read_meta(folder, job_id)
    if "_" not in job_id and meta.get("elements"):
        return array_status(folder, job_id, meta)
    return _status(folder, job_id, meta, slurm_job(job_id))


def _status(folder: Path, job_id: str, meta: dict[str, Any], slurm: dict[str, str] | None) -> dict[str, Any]:
    events = read_record(folder, job_id)
    if meta:  # a cluster whose state was wiped reuses job ids: older events are another job's
        submitted = meta.get("submitted_at", 0)
        events = [e for e in events if e.get("time", 0) >= submitted - 1]
    slurm_state = (slurm or {}).get("JobState")
    restarts = int((slurm or {}).get("Restarts", 0) or 0)
    # The supervisor's events decide; the ranks' own notes (ranks_stopped, rank_failed) only feed them.
    main = [e for e in events if e.get("event") not in ("ranks_stopped", "rank_failed")]
    last = main[-1] if main else {}
    starts = [e for e in events if e.get("event") == "start"]
    out: dict[str, Any] = {"job_id": job_id, "slurm_state": slurm_state, "restarts": max(restarts, len(starts) - 1, 0),
                           "last_event": last.get("event"), "reason": last.get("reason"),
                           "exit_code": last.get("exit_code"), "events": events}
    out["state"], reason = _state(slurm_state, restarts, last)
    if reason is not None:
        out["reason"] = reason
    if out["exit_code"] is None and slurm and slurm.get("ExitCode") and out["state"] in FINAL_STATES:
        out["exit_code"] = int(slurm["ExitCode"].split(":")[0])
    return out


def _state(slurm_state: str | None, restarts: int, last: dict[str, Any]) -> tuple[str, str | None]:
    """(state, the reason when Slurm's state decides it) from Slurm's state and the record's last event."""
    event = last.get("event")
    if slurm_state in _PENDING:
        if event == "requeued" or restarts:
            return "requeued", last.get("reason") if event == "requeued" else "slurm"
        return "pending", None
    if slurm_state in _RUNNING and event in (None, "start", "requeued"):
        return "running", None
    if event in ("completed", "failed"):
        return event, None
    if event == "cancelled" or slurm_state == "CANCELLED":
        return "cancelled", None
    if event == "requeued" and slurm_state in _SLURM_FINAL:  # the requeued job never restarted
        return _SLURM_FINAL[slurm_state], None
    if event in ("stopped", "requeued"):
        return ("timed_out" if last.get("reason") == "timeout" else "preempted"), None
    if event == "preempted":
        return "preempted", None
    if slurm_state in _SLURM_FINAL:
        return _SLURM_FINAL[slurm_state], None
    if slurm_state in _RUNNING:
        return "running", None
    return "unknown", None


def array_status(folder: Path, job_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The state of a job array (a sweep) and of each of its elements.

    The array is completed when every element is; once all have ended, failed, cancelled, timed_out or
    preempted in that order of precedence (its exit code: the first failed element's); before that, pending
    while no element has started, else running. One `scontrol` for all elements (Slurm lists each element
    that started, and one line for those still pending)."""
    slurm: dict[int, dict[str, str]] = {}
    for info in slurm_jobs(job_id):
        for task in array_tasks(info.get("ArrayTaskId", "")):
            slurm[task] = info
    elements = []
    for element in meta["elements"]:
        status = _status(folder, element["job_id"], meta, slurm.get(int(element["task"])))
        elements.append({**{k: status[k] for k in ("job_id", "state", "reason", "restarts", "exit_code")},
                         "task": element["task"], "run_dir": element["run_dir"], "params": element.get("params")})
    states = [e["state"] for e in elements]
    if all(s in FINAL_STATES for s in states):
        state = next((s for s in ("failed", "cancelled", "timed_out", "preempted", "unknown") if s in states),
                     "completed")
    elif all(s in ("pending", "unknown") for s in states):
        state = "pending"
    else:
        state = "running"
    failed = [e for e in elements if e["state"] == "failed"]
    return {"job_id": job_id, "array": True, "state": state, "reason": None, "slurm_state": None, "events": [],
            "restarts": sum(e["restarts"] for e in elements), "exit_code": failed[0]["exit_code"] if failed else None,
            "counts": {s: states.count(s) for s in dict.fromkeys(states)}, "elements": elements}


def list_jobs(folder: Path) -> list[dict[str, Any]]:
    """The hpctrain jobs submitted into `folder`, oldest first, each with its state (an array's with its
    elements')."""
    jobs = []
    for meta in sorted(Path(folder).glob("*_hpctrain.json"), key=lambda p: int(p.name.split("_")[0])):
        info = json.loads(meta.read_text())
        status = job_status(folder, info["job_id"])
        jobs.append({"job_id": info["job_id"], "state": status["state"], "reason": status["reason"],
                     "restarts": status["restarts"], "submitted_at": info.get("submitted_at"),
                     "command": info.get("command"), **({"elements": status["elements"], "counts": status["counts"]}
                                                        if status.get("array") else {})})
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


def announce(status: dict[str, Any], seen: dict[str, str], stream: TextIO) -> None:
    """Print one line for each element of an array whose state changed since the last call."""
    for element in status.get("elements", []):
        if seen.get(element["job_id"]) != element["state"]:
            seen[element["job_id"]] = element["state"]
            stream.write(f"hpctrain: {element['job_id']} {element['state']}: {element['run_dir']}\n")
            stream.flush()


def wait(folder: Path, job_id: str, *, stream: TextIO | None = None, poll_s: float = 1.0,
         timeout_s: float | None = None) -> dict[str, Any]:
    """Follow rank 0's log until the job has finished (through any requeues); return its final status. For a
    job array: until every element has finished, saying when each starts and ends."""
    job_id = check_job_id(job_id)
    positions: dict[Path, int] = {}
    seen: dict[str, str] = {}
    paths = [log_path(folder, job_id, 0, "err")]
    start = time.monotonic()
    while True:
        status = job_status(folder, job_id)
        if stream is not None and status.get("array"):
            announce(status, seen, stream)
        elif stream is not None:
            follow(paths, positions, stream)
        if status["state"] in FINAL_STATES and status["state"] != "unknown":
            return status
        if status["state"] == "unknown" and status["slurm_state"] is None and not status["events"] and \
                time.monotonic() - start > 30:
            return status
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise SubmissionError(f"job {job_id} still {status['state']} after {timeout_s:.0f} s")
        time.sleep(poll_s)
