"""The batch script `hpctrain submit` writes, pinned by golden files, and the checks made before it is written.

Golden files: tests/golden/sbatch-NAME.txt, and the same text in slurm/examples/NAME.sbatch. When a change
to the script is intended, regenerate both with

    HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_render.py

and review the diff.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hpctrain.cli import submit as submit_cli
from hpctrain.base.errors import ConfigError
from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.core import parse_duration, record
from hpctrain.tools.slurm.render import command_paths, render_sbatch
from hpctrain.tools.slurm.status import job_status
from hpctrain.tools.slurm.supervise import stop_reason, supervise

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = ROOT / "slurm" / "examples"
PY = "/opt/hpctrain/venv/bin/python"
TRAIN = ["train", "--data", "/scratch/data/digits", "--run-dir", "/scratch/runs/a", "--epochs", "20"]

# name -> (SubmitConfig keywords, the `hpctrain submit` flags that give them, COMMAND)
CASES: dict[str, tuple[dict, list[str], list[str]]] = {
    "cpu-2nodes": (dict(nodes=2), ["--nodes", "2"], TRAIN),
    "gpu-2x4-pmi2": (
        dict(nodes=2, gpus=4, cpus_per_task=8, partition="gpu", account="proj42", time=720, mpi="pmi2",
             env=("NCCL_DEBUG=INFO", "WANDB_NOTES=first try; don't $panic")),
        ["--nodes", "2", "--gpus", "4", "--cpus-per-task", "8", "--partition", "gpu", "--account", "proj42",
         "--time", "720", "--mpi", "pmi2", "--env", "NCCL_DEBUG=INFO", "--env", "WANDB_NOTES=first try; don't $panic"],
        TRAIN,
    ),
    "container-mpirun": (
        dict(nodes=4, gpus=8, container=Path("/scratch/images/hpctrain.sif"), mpi="mpirun", time=1440,
             max_requeues=20),
        ["--nodes", "4", "--gpus", "8", "--container", "/scratch/images/hpctrain.sif", "--mpi", "mpirun",
         "--time", "1440", "--max-requeues", "20"],
        TRAIN,
    ),
}


_APP = typer.Typer(pretty_exceptions_enable=False)
submit_cli.register(_APP)


@pytest.fixture(autouse=True)
def no_cluster(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests never talk to a cluster: Slurm's query commands are faked (they answer "no such job" at
    once), so a Slurm client left installed with its controller stopped cannot make them wait. The real
    cluster is exercised in tests/slurm/."""
    fake = tmp_path_factory.mktemp("fake-slurm")
    for name in ("scontrol", "squeue", "sbatch", "scancel"):
        (fake / name).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
        (fake / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


def make_app() -> typer.Typer:
    """The Slurm commands as cli/main.py registers them (submit_cli.register), on an app of their own."""
    return _APP


runner = CliRunner()


def command_argv(script: str) -> list[str]:
    """The words of the script's command, as bash would split them (line continuations joined)."""
    body = script.split("# command\n", 1)[1].replace("\\\n", "")
    line = next(line for line in body.splitlines() if line.startswith("exec "))
    return shlex.split(line)


def check_golden(name: str, text: str) -> None:
    for path in (GOLDEN / f"sbatch-{name}.txt", EXAMPLES / f"{name}.sbatch"):
        if os.environ.get("HPCTRAIN_REGEN_GOLDEN"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        want = path.read_text() if path.exists() else ""
        if text != want:
            diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "rendered"))
            pytest.fail(f"{path.relative_to(ROOT)} differs from the rendered script:\n{diff}\n"
                        "If the change is intended, regenerate with: HPCTRAIN_REGEN_GOLDEN=1 "
                        ".venv/bin/python -m pytest tests/unit/test_slurm_render.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_matches_golden(name: str) -> None:
    kwargs, _, command = CASES[name]
    cfg = SubmitConfig(folder=Path("/scratch/jobs"), python=PY, **kwargs)
    check_golden(name, render_sbatch(cfg, command))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_prints_the_same_script_and_submits_nothing(name: str, tmp_path: Path) -> None:
    kwargs, flags, command = CASES[name]
    args = ["submit", "--dry-run", "--folder", "/scratch/jobs", "--python", PY, *flags, "--", *command]
    result = runner.invoke(make_app(), args)
    assert result.exit_code == 0, result.output
    assert result.output == render_sbatch(SubmitConfig(folder=Path("/scratch/jobs"), python=PY, **kwargs), command)
    assert not Path("/scratch/jobs").exists()


def test_user_values_reach_the_ranks_exactly_as_given() -> None:
    nasty = ["train", "--data", "/d/with space", "--run-dir", "/r/$(touch pwned)", "--model", "x;y'z\"w"]
    cfg = SubmitConfig(folder=Path("/jobs dir"), python=PY, env=("NOTE=a'b $c",))
    script = render_sbatch(cfg, nasty)
    argv = command_argv(script)
    assert argv[0] == "exec" and argv[-len(nasty):] == nasty
    assert "/jobs dir" in argv
    env_line = next(line for line in script.splitlines() if line.startswith("export NOTE="))
    assert shlex.split(env_line.removeprefix("export ")) == ["NOTE=a'b $c"]


def test_every_rank_starts_through_srun_with_kill_on_bad_exit() -> None:
    script = render_sbatch(SubmitConfig(nodes=2, folder=Path("/j"), python=PY), TRAIN)
    argv = command_argv(script)
    srun = argv.index("srun")
    assert {"--mpi=pmix", "--kill-on-bad-exit=1"} <= set(argv[srun:])
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR2@90" in script
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in script and "export OMP_NUM_THREADS=1" in script


def test_tasks_per_node_default_to_gpus_and_one_without() -> None:
    assert SubmitConfig(gpus=4).tasks_per_node == 4
    assert SubmitConfig(gpus=0).tasks_per_node == 1
    assert SubmitConfig(gpus=4, nodes=3).world_size == 12


def test_container_binds_the_command_directories() -> None:
    cfg = SubmitConfig(container=Path("/img.sif"), folder=Path("/jobs"), python=PY)
    script = render_sbatch(cfg, ["train", "--data=/d", "--run-dir", "/r", "--epochs", "1"])
    argv = command_argv(script)
    binds = argv[argv.index("--bind") + 1].split(",")
    assert binds == ["/jobs", "/d", "/r"]
    assert "mkdir -p -- /d /r" in script
    assert argv[argv.index("/img.sif") + 1] == "python3"
    assert command_paths(["train", "--data", "rel", "--run-dir=x/y"]) == ["rel", "x/y"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(gpus=2, tasks_per_node=3), "--tasks-per-node 3 with --gpus 2"),
        (dict(nodes=0), "--nodes 0"),
        (dict(mpi="openmpi"), "choose one of pmix, pmi2, mpirun"),
        (dict(env=("NOEQUALS",)), "--env 'NOEQUALS'"),
        (dict(env=("1BAD=x",)), "--env '1BAD=x'"),
        (dict(time=1, signal_delay_s=90), "signal delay 90 s"),
        (dict(cpus_per_task=0), "--cpus-per-task 0"),
    ],
)
def test_bad_requests_name_the_field_and_the_fix(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        SubmitConfig(**kwargs)
    assert needle in str(info.value)


def test_cli_bad_request_is_one_line_and_exit_2() -> None:
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--gpus", "2", "--tasks-per-node", "3", "--", "train"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "error: --tasks-per-node 3" in result.output


def test_cli_without_command_says_what_to_write() -> None:
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--nodes", "1"])
    assert result.exit_code == 2


@pytest.mark.parametrize("cmd", ["submit", "jobs", "status", "logs", "cancel"])
def test_help_has_an_example(cmd: str) -> None:
    result = runner.invoke(make_app(), [cmd, "--help"])
    assert result.exit_code == 0 and "Example:" in result.output


def test_stop_reason_tells_timeout_from_preemption() -> None:
    assert stop_reason(80, 90) == "timeout"
    assert stop_reason(115, 90) == "timeout"
    assert stop_reason(600, 90) == "preempted"
    assert stop_reason(None, 90) == "preempted"  # unlimited or unknown: not a time limit


def test_parse_duration() -> None:
    assert parse_duration("1-02:03:04") == 93784
    assert parse_duration("02:03:04") == 7384
    assert parse_duration("03:04") == 184
    assert parse_duration("45") == 45
    assert parse_duration("UNLIMITED") is None


def test_supervisor_records_completion_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    assert supervise(tmp_path, ["true"], max_requeues=3, signal_delay_s=60) == 0
    assert job_status(tmp_path, "777")["state"] in ("completed",)
    monkeypatch.setenv("SLURM_JOB_ID", "778")
    assert supervise(tmp_path, ["sh", "-c", "exit 5"], max_requeues=3, signal_delay_s=60) == 5
    status = job_status(tmp_path, "778")
    assert status["state"] == "failed" and status["exit_code"] == 5
    assert [e["event"] for e in status["events"]] == ["start", "failed"]  # a failure never requeues


def test_status_tells_requeued_stopped_and_timeouts_apart(tmp_path: Path) -> None:
    record(tmp_path, "901", "start", restart=0)
    record(tmp_path, "901", "ranks_stopped", restart=0, exit_code=3)
    record(tmp_path, "901", "stopped", reason="timeout", restart=0, exit_code=3)
    assert job_status(tmp_path, "901")["state"] == "timed_out"
    record(tmp_path, "902", "start", restart=0)
    record(tmp_path, "902", "stopped", reason="preempted", restart=0, exit_code=3)
    assert job_status(tmp_path, "902")["state"] == "preempted"
    record(tmp_path, "903", "start", restart=0)
    record(tmp_path, "903", "cancelled", restart=0, exit_code=3)
    assert job_status(tmp_path, "903")["state"] == "cancelled"
    with pytest.raises(ConfigError, match="not a Slurm job id"):
        job_status(tmp_path, "12; rm -rf /")


def test_status_json_from_the_cli(tmp_path: Path) -> None:
    record(tmp_path, "904", "start", restart=0)
    record(tmp_path, "904", "completed", restart=0, exit_code=0)
    result = runner.invoke(make_app(), ["status", "904", "--folder", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output)["state"] == "completed"


def test_status_of_a_job_nobody_knows_is_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(make_app(), ["status", "999999", "--folder", str(tmp_path)])
    assert result.exit_code == 2 and "no job 999999" in result.output
