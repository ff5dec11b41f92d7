"""submitit's private API that hpctrain.tools.slurm.submitit_private relies on, checked against the installed
submitit: the names, their parameters, and what `_submit_command` does with our script.

When one of these fails, submitit changed: the message names the installed version and what changed. Keep
pyproject.toml's pin (`submitit>=1.5,<1.6`) or adapt hpctrain/tools/slurm/submitit_private.py (its docstring
says why it uses private names), then widen the pin.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import submitit
from submitit.slurm import slurm as submitit_slurm

from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.render import render_sbatch, sbatch_parameters
from hpctrain.tools.slurm.submission import submit
from hpctrain.tools.slurm.sweep import sweep_elements, sweep_file

PY = "/opt/hpctrain/venv/bin/python"
TRAIN = ["train", "--data", "/scratch/data/digits", "--run-dir", "/scratch/runs/a"]
# Configurations that between them pass every sbatch parameter hpctrain uses.
CONFIGS = [SubmitConfig(nodes=2, folder=Path("/j"), python=PY, cpus_per_task=1),
           SubmitConfig(gpus=4, partition="gpu", account="proj42", mpi="mpirun", folder=Path("/j"), python=PY,
                        cpus_per_task=8),
           SubmitConfig(sweep=("lr=0.1,0.2",), max_parallel=1, folder=Path("/j"), python=PY, cpus_per_task=1)]


def changed(what: str) -> str:
    return (f"submitit {submitit.__version__} changed {what}, which hpctrain.tools.slurm.submitit_private relies "
            "on: keep submitit>=1.5,<1.6 (pyproject.toml) or adapt that module, then widen the pin")


def test_make_sbatch_string_takes_every_parameter_hpctrain_passes() -> None:
    writer = getattr(submitit_slurm, "_make_sbatch_string", None)
    assert callable(writer), changed("submitit.slurm.slurm._make_sbatch_string (it is gone)")
    params = inspect.signature(writer).parameters
    used = {"command", "folder", "map_count"}.union(*(sbatch_parameters(cfg, TRAIN) for cfg in CONFIGS))
    missing = sorted(used - set(params))
    assert not missing, changed(f"submitit.slurm.slurm._make_sbatch_string: it no longer takes {missing}")
    assert list(params)[:2] == ["command", "folder"], changed(
        f"submitit.slurm.slurm._make_sbatch_string's first parameters (now {list(params)[:2]})")


def test_submit_command_takes_one_command() -> None:
    method = getattr(submitit.SlurmExecutor, "_submit_command", None)
    assert callable(method), changed("SlurmExecutor._submit_command (it is gone)")
    params = list(inspect.signature(method).parameters)
    assert params == ["self", "command"], changed(f"SlurmExecutor._submit_command's parameters (now {params})")


def test_map_count_makes_a_job_array() -> None:
    """submitit writes `--array=0-(N-1)%K` and names the logs %A_%a for `map_count` N (K: array_parallelism)."""
    text = submitit_slurm._make_sbatch_string(command="true", folder="/j", map_count=4, array_parallelism=2)
    assert "#SBATCH --array=0-3%2" in text.splitlines(), changed("how map_count makes a job array")
    assert "#SBATCH --output=/j/%A_%a_0_log.out" in text.splitlines(), changed("the log names of a job array")


def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """FAKE srun and sbatch (only the scheduler's commands): sbatch keeps a copy of the script it gets and a
    log of its arguments, and answers job 4242."""
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
    return log, copy


def test_submit_hands_the_rendered_script_to_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through FAKE srun and sbatch: the file sbatch gets is what --dry-run prints, and the job id is read from
    sbatch's answer."""
    log, copy = fake_sbatch(tmp_path, monkeypatch)
    cfg = SubmitConfig(nodes=2, folder=tmp_path / "jobs", python=PY, cpus_per_task=1)
    info = submit(cfg, TRAIN)
    want = render_sbatch(cfg, TRAIN)
    assert info["job_id"] == "4242", changed(f"how _submit_command reads the job id (got {info['job_id']!r})")
    assert copy.read_text() == want, changed("the script _submit_command writes for a command")
    assert Path(info["script"]).read_text() == want, changed(f"where the submitted script is kept ({info['script']})")
    assert log.read_text().splitlines()[0].startswith("--test-only ")


def test_a_sweep_is_submitted_as_one_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through FAKE srun and sbatch: one sbatch of the array script; the sweep file it names is written first;
    the submission's note lists the elements JOBID_TASK."""
    log, copy = fake_sbatch(tmp_path, monkeypatch)
    cfg = SubmitConfig(sweep=("lr=0.1,0.2", "seed=1,2,3"), max_parallel=2, folder=tmp_path / "jobs", python=PY,
                       cpus_per_task=1)
    info = submit(cfg, TRAIN)
    want = render_sbatch(cfg, TRAIN)
    assert copy.read_text() == want, changed("the script _submit_command writes for a job array")
    assert "#SBATCH --array=0-5%2" in want.splitlines()
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and calls[0].startswith("--test-only ") and not calls[1].startswith("--")  # one array
    assert Path(info["script"]).read_text() == want
    elements = sweep_elements(cfg.sweep, TRAIN)
    written = json.loads(sweep_file(cfg.folder, elements).read_text())["elements"]
    assert [e["args"] for e in written] == [e["args"] for e in elements]
    assert [e["job_id"] for e in info["elements"]] == [f"4242_{i}" for i in range(6)]
    assert info["elements"][5]["run_dir"] == "/scratch/runs/a/lr=0.2_seed=3" and info["run_dir"] == "/scratch/runs/a"
    assert json.loads((cfg.folder / "4242_hpctrain.json").read_text())["elements"] == info["elements"]
