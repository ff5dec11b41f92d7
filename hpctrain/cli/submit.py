"""`hpctrain submit`, `jobs`, `status`, `logs`, `cancel`: training jobs on Slurm."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..base.errors import HpctrainError
from ..tools.slurm.config import SubmitConfig
from .common import fail, handle_errors
from .options import config_parameters, config_values, with_signature

FOLDER_HELP = "Job folder: batch scripts, logs (JOBID_RANK_log.out/.err) and job records."
Folder = Annotated[Path, typer.Option("--folder", help=FOLDER_HELP)]
DEFAULT_FOLDER = Path("hpctrain-jobs")


@handle_errors
def submit(
    command: Annotated[list[str], typer.Argument(help="An hpctrain subcommand (train ...) or any program.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the batch script; submit nothing.")] = False,
    wait_: Annotated[bool, typer.Option("--wait", help="Follow rank 0 until the job ends (a sweep: every element, "
                                        "then RUN/report compares the runs); exit with its code.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help='Print one JSON object {"job_id": ...}.')] = False,
    **values: Any,
) -> None:
    """Submit COMMAND as an MPI job on Slurm: one rank per GPU, requeued after preemption or timeout. With
    --sweep, one job array: an element per combination of the values, each in RUN/KEY=V[_KEY=V...].

    `--dry-run` prints the batch script and submits nothing.

    Example: hpctrain submit --nodes 2 --gpus 4 --time 120 -- train --data data/ --run-dir runs/a

    Example: hpctrain submit --sweep lr=0.01,0.1 --sweep batch-size=16,64 --max-parallel 2 --wait -- train
    --data data/ --run-dir runs/sweep
    """
    from ..tools.slurm.cpus import with_cpus
    from ..tools.slurm.render import render_sbatch
    from ..tools.slurm.status import exit_code, wait as run_wait
    from ..tools.slurm.submission import submit as run_submit
    from ..tools.slurm.sweep import sweep_elements

    cfg = with_cpus(SubmitConfig(**config_values(SubmitConfig, values)))
    cfg.folder = cfg.folder.resolve()
    if dry_run:
        script = render_sbatch(cfg, command)
        elements = [{k: e[k] for k in ("task", "run_dir", "params")} for e in sweep_elements(cfg.sweep, command)]
        print(json.dumps({"job_id": None, "script": script, **({"elements": elements} if elements else {})})
              if json_out else script, end="" if not json_out else "\n")
        return
    info = run_submit(cfg, command)
    if not json_out:
        print(info["job_id"], flush=True)
        for element in info.get("elements", []):
            print(f"  {element['job_id']}  {element['run_dir']}", file=sys.stderr)
    if not wait_:
        if json_out:
            print(json.dumps(info))
        return
    status = run_wait(cfg.folder, info["job_id"], stream=sys.stderr)
    code = exit_code(status)
    report = _sweep_report(info, status) if info.get("elements") else None
    if json_out:
        print(json.dumps({**info, "state": status["state"], "reason": status["reason"], "restarts": status["restarts"],
                          "exit_code": code, **_array_fields(status, report)}))
    else:
        print(f"job {info['job_id']}: {_describe(status)}", file=sys.stderr)
    raise typer.Exit(code)


with_signature(submit, config_parameters(SubmitConfig, skip=("job_name", "signal_delay_s", "binds", "container_python"),
                                         flags={"env": "--env"}))


def _sweep_report(info: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """RUN/report: the comparison of every element's run (see hpctrain.tools.compare), said on stderr. When
    some element did not complete, a report that cannot be made is a note, and the array's code stands."""
    from ..tools.slurm.sweep import compare_sweep

    out = Path(info["run_dir"]) / "report"
    try:
        result = compare_sweep([e["run_dir"] for e in info["elements"]], out)
    except HpctrainError as exc:
        if status["state"] == "completed":
            raise
        print(f"no report: {exc}", file=sys.stderr)
        return None
    print(f"report: {out} (best: {result.get('best')}, by {result.get('criterion')})", file=sys.stderr)
    return {"dir": str(out), "best": result.get("best"), "criterion": result.get("criterion"),
            "files": {k: str(v) for k, v in result.get("files", {}).items()}}


def _array_fields(status: dict[str, Any], report: dict[str, Any] | None) -> dict[str, Any]:
    if not status.get("array"):
        return {}
    return {"elements": status["elements"], "report": report}


def _describe(status: dict[str, Any]) -> str:
    text = status["state"]
    if status.get("counts"):
        text += f" ({', '.join(f'{n} {state}' for state, n in status['counts'].items())})"
    if status["state"] == "requeued":
        text += f" after {'the time limit' if status['reason'] == 'timeout' else 'preemption'}"
    if status.get("restarts"):
        text += f" (restarts: {status['restarts']})"
    if status["state"] in ("failed",) and status.get("exit_code") is not None:
        text += f", exit code {status['exit_code']}"
    return text


@handle_errors
def jobs(
    folder: Folder = DEFAULT_FOLDER,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List the hpctrain jobs submitted into --folder, with their states.

    Example: hpctrain jobs --folder hpctrain-jobs
    """
    from ..tools.slurm.status import list_jobs

    listed = list_jobs(folder)
    if json_out:
        print(json.dumps(listed))
        return
    if not listed:
        print(f"no hpctrain jobs in {folder}")
        return
    for job in listed:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(job["submitted_at"])) if job.get("submitted_at") else "?"
        print(f"{job['job_id']:>8}  {_describe(job):<28}  {when}  {' '.join(job.get('command') or [])}")
        for element in job.get("elements", []):
            print(f"{element['job_id']:>10}  {_describe(element):<26}  {element['run_dir']}")


@handle_errors
def status(
    job_id: Annotated[str, typer.Argument(help="The job id `hpctrain submit` printed.")],
    folder: Folder = DEFAULT_FOLDER,
    json_out: Annotated[bool, typer.Option("--json", help="Print the status and the job's record as JSON.")] = False,
) -> None:
    """Say whether a job is pending, running, requeued (preempted or timed out), completed, failed or cancelled.
    The id of a sweep's job array gives the state of every element; JOBID_TASK, one element's record.

    Example: hpctrain status 1234
    """
    from ..tools.slurm.status import job_status

    info = job_status(folder, job_id)
    if info["state"] == "unknown" and not info["events"] and info["slurm_state"] is None and not info.get("array"):
        raise fail(f"no job {job_id} in {folder} and Slurm does not know it: check the job id (`hpctrain jobs`) "
                   "and --folder")
    if json_out:
        print(json.dumps(info))
        return
    print(f"job {job_id}: {_describe(info)}")
    for element in info.get("elements", []):
        print(f"  {element['job_id']:>10}  {_describe(element):<26}  {element['run_dir']}")
    for event in info["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        extra = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("time", "event", "pid"))
        print(f"  {when}  {event['event']:<10} {extra}")


@handle_errors
def logs(
    job_id: Annotated[str, typer.Argument(help="The job id `hpctrain submit` printed.")],
    rank: Annotated[int, typer.Option(help="Whose log: the global rank.")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    folder: Folder = DEFAULT_FOLDER,
) -> None:
    """Print a rank's log (stdout, then stderr) of a job; rank 0's also holds the job's own messages.

    Example: hpctrain logs 1234 --rank 1 --follow
    """
    from ..tools.slurm.core import check_job_id, log_path, read_meta
    from ..tools.slurm.status import FINAL_STATES, follow as follow_files, job_status

    job_id = check_job_id(job_id)
    out, err = log_path(folder, job_id, rank, "out"), log_path(folder, job_id, rank, "err")
    elements = read_meta(folder, job_id).get("elements") if "_" not in job_id else None
    if elements:
        raise fail(f"job {job_id} is a job array (a sweep): name one element, e.g. `hpctrain logs "
                   f"{elements[0]['job_id']}` (`hpctrain status {job_id}` lists them)")
    if not follow and not out.exists() and not err.exists():
        raise fail(f"no log of rank {rank} of job {job_id} in {folder} (yet): check the job id, --folder and --rank")
    positions: dict[Path, int] = {}
    follow_files([out], positions, sys.stdout)
    follow_files([err], positions, sys.stderr)
    while follow and job_status(folder, job_id)["state"] not in FINAL_STATES:
        time.sleep(1)
        follow_files([out], positions, sys.stdout)
        follow_files([err], positions, sys.stderr)
    follow_files([out], positions, sys.stdout)
    follow_files([err], positions, sys.stderr)


@handle_errors
def cancel(
    job_id: Annotated[str, typer.Argument(help="The job id `hpctrain submit` printed.")],
    folder: Folder = DEFAULT_FOLDER,
) -> None:
    """Cancel a job: its ranks checkpoint at the next step boundary and it ends without requeueing. The id of
    a sweep's job array cancels every element; JOBID_TASK, one element.

    Example: hpctrain cancel 1234
    """
    from ..tools.slurm.core import read_meta
    from ..tools.slurm.submission import cancel as run_cancel

    run_cancel(folder, job_id)
    elements = read_meta(folder, job_id).get("elements") if "_" not in job_id else None
    print(f"cancelled {job_id}" + (f" (a job array: all {len(elements)} elements)" if elements else ""))


def register(app: typer.Typer) -> None:
    """Add submit, jobs, status, logs and cancel to the hpctrain application."""
    app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(submit)
    for command in (jobs, status, logs, cancel):
        app.command()(command)
