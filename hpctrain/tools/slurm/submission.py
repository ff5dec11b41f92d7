"""Submitting and cancelling a job through submitit: `submit(cfg, command)`, `test_only(script)`, `cancel`.

`submit` resolves `--cpus-per-task auto` (sinfo), asks Slurm whether it could run the script (`sbatch
--test-only`, where the cluster allows it), then hands the very text `render_sbatch` returns to sbatch, and
notes the submission in the job folder (JOBID_hpctrain.json) for `hpctrain jobs` and `status`. A sweep's
elements are written into the job folder before its array is submitted (see `sweep`).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from ...base.errors import SubmissionError
from .config import SubmitConfig
from .core import check_job_id, meta_path, run_slurm
from .cpus import with_cpus
from .render import batch_command, render_sbatch, sbatch_parameters
from .submitit_private import submit_command
from .sweep import command_run_dir, sweep_elements, write_sweep_file


def test_only(script: str) -> str | None:
    """Ask Slurm whether it could run the script (`sbatch --test-only`); raise SubmissionError if not.

    Returns Slurm's answer, or None where the cluster does not allow the check.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="hpctrain-test-") as fh:
        fh.write(script)
        fh.flush()
        proc = run_slurm(["sbatch", "--test-only", fh.name])
    text = (proc.stderr + proc.stdout).strip()
    if proc.returncode == 0:
        return text
    if re.search(r"not (supported|allowed|permitted)|disabled", text, re.I):
        return None
    text = re.sub(r"(?i)\bsbatch: error: ", "", text)  # one line in hpctrain's style, not sbatch's prefixes
    raise SubmissionError(f"Slurm refuses this job: {text.replace(chr(10), ' ')} (check --nodes, --gpus, "
                          "--tasks-per-node, --partition and --time against `sinfo`)")


def submit(cfg: SubmitConfig, command: Sequence[str]) -> dict[str, Any]:
    """Submit COMMAND as a Slurm job through submitit, or with --sweep as a job array of one element per
    combination; return {"job_id", "folder", "script", ...} (a sweep's also "run_dir" and "elements", each
    {"job_id": JOBID_TASK, "task", "run_dir", "params"})."""
    cfg = with_cpus(cfg)
    cfg.folder = cfg.folder.resolve()
    elements = sweep_elements(cfg.sweep, command)
    script = render_sbatch(cfg, command)
    test_only(script)
    cfg.folder.mkdir(parents=True, exist_ok=True)
    if elements:
        write_sweep_file(cfg.folder, elements)
    import submitit

    try:
        executor = submitit.SlurmExecutor(folder=cfg.folder, python=shlex.quote(cfg.python))
        executor.update_parameters(**sbatch_parameters(cfg, command))
        submitted_at = time.time()
        # Our script is the command itself (no pickled function): submitit writes it and calls sbatch.
        job = submit_command(executor, batch_command(cfg, command), array_size=len(elements) or None)
    except RuntimeError as exc:
        raise SubmissionError(f"cannot submit: {exc}; start the local cluster with `make slurm-up` or use --dry-run") from None
    except Exception as exc:  # noqa: BLE001 - sbatch's own message is the useful part
        text = str(exc).strip().replace("\n", " ")
        raise SubmissionError(f"sbatch failed: {text}") from None
    info = {"job_id": str(job.job_id), "folder": str(cfg.folder), "script": str(job.paths.submission_file),
            "submitted_at": submitted_at, "command": list(command), "world_size": cfg.world_size,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}}
    if elements:
        info["run_dir"] = command_run_dir(command)
        info["elements"] = [{"job_id": f"{job.job_id}_{e['task']}", "task": e["task"], "run_dir": e["run_dir"],
                             "params": e["params"]} for e in elements]
    meta_path(cfg.folder, info["job_id"]).write_text(json.dumps(info, indent=2) + "\n")
    return info


def cancel(folder: Path, job_id: str) -> None:
    """Cancel a job (scancel): its ranks get SIGTERM, checkpoint at the next step boundary, and it ends. The id
    of a job array cancels every element; JOBID_TASK one element."""
    import submitit

    job_id = check_job_id(job_id)
    job = submitit.SlurmJob(folder=Path(folder), job_id=job_id)
    try:
        job.cancel(check=True)
    except subprocess.CalledProcessError as exc:
        raise SubmissionError(f"scancel {job_id} failed: {(exc.stderr or exc.output or b'').decode().strip()}") from None
