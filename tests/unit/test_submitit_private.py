"""submitit's private API that hpctrain.tools.slurm.submitit_private relies on, checked against the installed
submitit: the names, their parameters, and what `_submit_command` does with our script.

When one of these fails, submitit changed: the message names the installed version and what changed. Keep
pyproject.toml's pin (`submitit>=1.5,<1.6`) or adapt hpctrain/tools/slurm/submitit_private.py (its docstring
says why it uses private names), then widen the pin.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import submitit
from submitit.slurm import slurm as submitit_slurm

from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.render import render_sbatch, sbatch_parameters
from hpctrain.tools.slurm.submission import submit

PY = "/opt/hpctrain/venv/bin/python"
TRAIN = ["train", "--data", "/scratch/data/digits", "--run-dir", "/scratch/runs/a"]
# Configurations that between them pass every sbatch parameter hpctrain uses.
CONFIGS = [SubmitConfig(nodes=2, folder=Path("/j"), python=PY),
           SubmitConfig(gpus=4, partition="gpu", account="proj42", mpi="mpirun", folder=Path("/j"), python=PY)]


def changed(what: str) -> str:
    return (f"submitit {submitit.__version__} changed {what}, which hpctrain.tools.slurm.submitit_private relies "
            "on: keep submitit>=1.5,<1.6 (pyproject.toml) or adapt that module, then widen the pin")


def test_make_sbatch_string_takes_every_parameter_hpctrain_passes() -> None:
    writer = getattr(submitit_slurm, "_make_sbatch_string", None)
    assert callable(writer), changed("submitit.slurm.slurm._make_sbatch_string (it is gone)")
    params = inspect.signature(writer).parameters
    used = {"command", "folder"}.union(*(sbatch_parameters(cfg, TRAIN) for cfg in CONFIGS))
    missing = sorted(used - set(params))
    assert not missing, changed(f"submitit.slurm.slurm._make_sbatch_string: it no longer takes {missing}")
    assert list(params)[:2] == ["command", "folder"], changed(
        f"submitit.slurm.slurm._make_sbatch_string's first parameters (now {list(params)[:2]})")


def test_submit_command_takes_one_command() -> None:
    method = getattr(submitit.SlurmExecutor, "_submit_command", None)
    assert callable(method), changed("SlurmExecutor._submit_command (it is gone)")
    params = list(inspect.signature(method).parameters)
    assert params == ["self", "command"], changed(f"SlurmExecutor._submit_command's parameters (now {params})")


def test_submit_hands_the_rendered_script_to_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through FAKE srun and sbatch (only the scheduler's commands): the file sbatch gets is what --dry-run
    prints, and the job id is read from sbatch's answer."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log, copy = tmp_path / "sbatch.log", tmp_path / "submitted.sh"
    (fake / "srun").write_text("#!/bin/sh\nexit 0\n")
    (fake / "sbatch").write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> '{log}'\n"
        'if [ "$1" = "--test-only" ]; then echo "sbatch: Job 4242 to start at 2030-01-01T00:00:00" >&2; exit 0; fi\n'
        f"cp \"$1\" '{copy}'\n"
        "echo 'Submitted batch job 4242'\n")
    for name in ("srun", "sbatch"):
        (fake / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    cfg = SubmitConfig(nodes=2, folder=tmp_path / "jobs", python=PY)
    info = submit(cfg, TRAIN)
    want = render_sbatch(cfg, TRAIN)
    assert info["job_id"] == "4242", changed(f"how _submit_command reads the job id (got {info['job_id']!r})")
    assert copy.read_text() == want, changed("the script _submit_command writes for a command")
    assert Path(info["script"]).read_text() == want, changed(f"where the submitted script is kept ({info['script']})")
    assert log.read_text().splitlines()[0].startswith("--test-only ")
