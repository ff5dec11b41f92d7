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
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hpctrain.cli import submit as submit_cli
from hpctrain.base.errors import ConfigError
from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.core import array_tasks, meta_path, parse_duration, record, record_path
from hpctrain.tools.slurm.cpus import gpu_count, resolve_cpus
from hpctrain.tools.slurm.render import command_paths, render_sbatch
from hpctrain.tools.slurm.status import job_status
from hpctrain.tools.slurm.supervise import stop_reason, supervise
from hpctrain.tools.slurm.sweep import sweep_elements, sweep_file, write_sweep_file

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = ROOT / "slurm" / "examples"
PY = "/opt/hpctrain/venv/bin/python"
TRAIN = ["train", "--data", "/scratch/data/digits", "--run-dir", "/scratch/runs/a", "--epochs", "20"]
# What `sinfo -h -o "%P %c %G"` answers on a made-up site: a default CPU partition, and a GPU partition of two
# node shapes (--cpus-per-task auto is resolved from it; see test_cpus_per_task_auto_shares_the_node).
SINFO = "cpu* 64 (null)\ngpu 64 gpu:a100:8(S:0-1)\ngpu 128 gpu:h100:8(S:0-1)\n"

# name -> (SubmitConfig keywords, the `hpctrain submit` flags that give them, COMMAND); without cpus_per_task,
# the default `auto` is resolved from SINFO.
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
        dict(nodes=4, gpus=8, partition="gpu", container=Path("/scratch/images/hpctrain.sif"), mpi="mpirun", time=1440,
             max_requeues=20),
        ["--nodes", "4", "--gpus", "8", "--partition", "gpu", "--container", "/scratch/images/hpctrain.sif", "--mpi", "mpirun",
         "--time", "1440", "--max-requeues", "20"],
        TRAIN,
    ),
    "sweep-array": (
        dict(gpus=4, partition="gpu", time=30, sweep=("lr=0.01,0.1", "batch-size=16,64"), max_parallel=2),
        ["--gpus", "4", "--partition", "gpu", "--time", "30", "--sweep", "lr=0.01,0.1", "--sweep", "batch-size=16,64",
         "--max-parallel", "2"],
        ["train", "--data", "/scratch/data/digits", "--run-dir", "/scratch/runs/sweep", "--max-steps", "200"],
    ),
}


def case_config(name: str) -> SubmitConfig:
    """The SubmitConfig of a case, its --cpus-per-task auto resolved from SINFO (a value: no process)."""
    kwargs, _, _ = CASES[name]
    return resolve_cpus(SubmitConfig(folder=Path("/scratch/jobs"), python=PY, **kwargs), SINFO)


_APP = typer.Typer(pretty_exceptions_enable=False)
submit_cli.register(_APP)


@pytest.fixture(autouse=True)
def no_cluster(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests never talk to a cluster: Slurm's query commands are faked (they answer "no such job" at
    once), so a Slurm client left installed with its controller stopped cannot make them wait. The real
    cluster is exercised in tests/slurm/."""
    fake = tmp_path_factory.mktemp("fake-slurm")
    for name in ("scontrol", "squeue", "sbatch", "scancel", "sinfo"):
        (fake / name).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
        (fake / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


def fake_sinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str) -> None:
    """A FAKE sinfo (the made-up site's; no cluster in unit tests) that answers TABLE, first on PATH."""
    fake = tmp_path / "fake-sinfo"
    fake.mkdir()
    (fake / "sinfo").write_text(f"#!/bin/sh\nprintf '%s' {shlex.quote(table)}\n")
    (fake / "sinfo").chmod(0o755)
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
    _, _, command = CASES[name]
    check_golden(name, render_sbatch(case_config(name), command))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_prints_the_same_script_and_submits_nothing(name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _, flags, command = CASES[name]
    fake_sinfo(tmp_path, monkeypatch, SINFO)
    args = ["submit", "--dry-run", "--folder", "/scratch/jobs", "--python", PY, *flags, "--", *command]
    result = runner.invoke(make_app(), args)
    assert result.exit_code == 0, result.output
    assert result.output == render_sbatch(case_config(name), command)
    assert not Path("/scratch/jobs").exists()


def test_user_values_reach_the_ranks_exactly_as_given() -> None:
    nasty = ["train", "--data", "/d/with space", "--run-dir", "/r/$(touch pwned)", "--model", "x;y'z\"w"]
    cfg = SubmitConfig(folder=Path("/jobs dir"), python=PY, env=("NOTE=a'b $c",), cpus_per_task=1)
    script = render_sbatch(cfg, nasty)
    argv = command_argv(script)
    assert argv[0] == "exec" and argv[-len(nasty):] == nasty
    assert "/jobs dir" in argv
    env_line = next(line for line in script.splitlines() if line.startswith("export NOTE="))
    assert shlex.split(env_line.removeprefix("export ")) == ["NOTE=a'b $c"]


def test_every_rank_starts_through_srun_with_kill_on_bad_exit() -> None:
    script = render_sbatch(SubmitConfig(nodes=2, folder=Path("/j"), python=PY, cpus_per_task=1), TRAIN)
    argv = command_argv(script)
    srun = argv.index("srun")
    assert {"--mpi=pmix", "--kill-on-bad-exit=1", "--cpus-per-task=1"} <= set(argv[srun:])  # srun does not inherit it
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR2@90" in script
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in script and "export OMP_NUM_THREADS=1" in script


def test_tasks_per_node_default_to_gpus_and_one_without() -> None:
    assert SubmitConfig(gpus=4).tasks_per_node == 4
    assert SubmitConfig(gpus=0).tasks_per_node == 1
    assert SubmitConfig(gpus=4, nodes=3).world_size == 12


def test_container_binds_the_command_directories() -> None:
    cfg = SubmitConfig(container=Path("/img.sif"), folder=Path("/jobs"), python=PY, cpus_per_task=1)
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
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--nodes", "1", "--cpus-per-task", "1"])
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


def test_a_requeue_that_ends_the_job_before_scontrol_exits_is_a_requeue(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm ends the allocation the moment `scontrol requeue` takes: its SIGTERM reaches the supervisor and
    scontrol itself (a process of the job), which then dies of it with no output. Through a FAKE scontrol that
    does just that (the supervisor here is this process, which holds SIGTERM while it supervises)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\n[ "$1" = requeue ] || exit 1\nkill -TERM $PPID\nkill -TERM $$\nsleep 5\n')
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "779")
    start = time.monotonic()
    assert supervise(tmp_path, ["sh", "-c", "exit 3"], max_requeues=3, signal_delay_s=60) == 3
    assert [e["event"] for e in job_status(tmp_path, "779")["events"]] == ["start", "requeued"]  # not "stopped"
    assert time.monotonic() - start < 30  # it left on Slurm's SIGTERM, which came already (not after a 60 s wait)


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


# -- --cpus-per-task auto: resolved from sinfo's answer, passed in as a value ---------------------------------

@pytest.mark.parametrize("kwargs, want", [
    (dict(), 64),  # the default partition (cpu*), one rank per node: the whole node
    (dict(tasks_per_node=16), 4),
    (dict(partition="gpu", gpus=8), 8),  # two node shapes: the smaller share, min(64/8, 128/8)
    (dict(partition="gpu", gpus=2), 8),  # two of 8 GPUs: their share of the node (64/8), not 64/2
    (dict(partition="gpu"), 64),  # a CPU job on GPU nodes: the node's CPUs over its ranks
    (dict(tasks_per_node=100), 1),  # more ranks than CPUs: never 0
    (dict(cpus_per_task=3), 3),  # a number stays as it is
    (dict(cpus_per_task="5"), 5),  # as the CLI passes it
])
def test_cpus_per_task_auto_shares_the_node(kwargs: dict, want: int) -> None:
    assert resolve_cpus(SubmitConfig(**kwargs), SINFO).cpus_per_task == want


def test_gpus_the_partition_does_not_have_are_refused_before_submitting(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `submit --dry-run --gpus 4` on a partition without GPUs said nothing (it read the CPUs from sinfo
    already), and the job would have waited in the queue forever."""
    with pytest.raises(ConfigError, match=r"--gpus 16: the nodes of partition 'gpu' have at most 8 GPUs per node"):
        resolve_cpus(SubmitConfig(gpus=16, partition="gpu"), SINFO)
    with pytest.raises(ConfigError, match=r"--gpus 2: the nodes of the default partition have no GPUs"):
        resolve_cpus(SubmitConfig(gpus=2), SINFO)
    assert resolve_cpus(SubmitConfig(gpus=8, partition="gpu"), SINFO).cpus_per_task == 8
    fake_sinfo(tmp_path, monkeypatch, SINFO)  # a number of CPUs needs no sinfo, but where it answers, it is asked
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--gpus", "4", "--cpus-per-task", "4", "--", *TRAIN])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: --gpus 4: the nodes of the default partition have no GPUs"), result.output


def test_gpu_count_reads_sinfo_s_gres_column() -> None:
    assert gpu_count("(null)") == 0
    assert gpu_count("gpu:4") == 4
    assert gpu_count("gpu:a100:8(S:0-1)") == 8
    assert gpu_count("shard:8,gpu:2") == 2
    assert gpu_count("mps:100") == 0


def test_cpus_per_task_auto_without_an_answer_says_to_pass_a_number(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="partition 'big'.*pass a number"):
        resolve_cpus(SubmitConfig(partition="big"), SINFO)
    with pytest.raises(ConfigError, match="resolved before the script is written"):
        render_sbatch(SubmitConfig(), TRAIN)  # rendering does no I/O: `auto` must be resolved first
    # sinfo fails (no_cluster's sinfo: no controller): one line, exit 2, the fix named
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--gpus", "2", "--", *TRAIN])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "--cpus-per-task auto: `sinfo -h -o '%P %c %G'` failed" in result.output and "pass a number" in result.output
    # no sinfo at all (no Slurm on this host)
    empty = tmp_path / "no-slurm"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--gpus", "2", "--", *TRAIN])
    assert result.exit_code == 2 and "which this machine does not have" in result.output, result.output
    assert "pass a number instead, e.g. --cpus-per-task 8" in result.output
    result = runner.invoke(make_app(), ["submit", "--dry-run", "--gpus", "2", "--cpus-per-task", "6", "--", *TRAIN])
    assert result.exit_code == 0 and "#SBATCH --cpus-per-task=6" in result.output  # a number needs no sinfo


# -- sweeps: one job array, an element per combination ---------------------------------------------------------

SWEEP_TRAIN = ["train", "--data", "d", "--run-dir", "runs/s", "--lr", "0.5"]


def test_a_sweep_is_the_grid_in_the_order_given() -> None:
    sweep = ("lr=0.01,0.10", "batch-size=16,64", "shuffle=false")
    elements = sweep_elements(sweep, SWEEP_TRAIN)
    assert [e["task"] for e in elements] == [0, 1, 2, 3] and SubmitConfig(sweep=sweep).array_size == 4
    assert [e["run_dir"] for e in elements] == [  # keys in the order given, values as written
        "runs/s/lr=0.01_batch-size=16_shuffle=false", "runs/s/lr=0.01_batch-size=64_shuffle=false",
        "runs/s/lr=0.10_batch-size=16_shuffle=false", "runs/s/lr=0.10_batch-size=64_shuffle=false"]
    assert elements[2]["params"] == {"lr": "0.10", "batch-size": "16", "shuffle": "false"}
    assert elements[2]["args"] == ["--lr", "0.10", "--batch-size", "16", "--no-shuffle",
                                   "--run-dir", "runs/s/lr=0.10_batch-size=16_shuffle=false"]
    assert sweep_elements((), SWEEP_TRAIN) == [] and SubmitConfig().array_size == 0


def test_an_element_s_flags_override_the_command_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real `train` CLI: what an element appends wins over what the command says."""
    from hpctrain.cli.main import app

    seen = []
    monkeypatch.setattr("hpctrain.control.trainer.train", lambda cfg: seen.append(cfg) or {})
    element = sweep_elements(("lr=0.2", "shuffle=false", "batch_size=8"), [*SWEEP_TRAIN, "--batch-size", "4"])[0]
    result = runner.invoke(app, [*SWEEP_TRAIN, "--batch-size", "4", *element["args"]])
    assert result.exit_code == 0, result.output
    cfg = seen[-1]
    assert (cfg.optimizer.lr, cfg.data.shuffle, cfg.data.batch_size) == (0.2, False, 8)
    assert cfg.run.run_dir == Path("runs/s/lr=0.2_shuffle=false_batch_size=8")


@pytest.mark.parametrize("sweep, command, needle", [
    (("lrr=0.1",), SWEEP_TRAIN, "key 'lrr' is not a flag of `hpctrain train` that a sweep can vary; valid keys: "
                                "data, model, epochs, max-steps, batch-size, lr,"),
    (("run-dir=a,b",), SWEEP_TRAIN, "key 'run-dir' is not a flag"),
    (("lr",), SWEEP_TRAIN, "must be KEY=V1,V2,..."),
    (("lr=",), SWEEP_TRAIN, "'lr=' has an empty value"),
    (("lr=0.1,,0.2",), SWEEP_TRAIN, "'lr=0.1,,0.2' has an empty value"),
    (("lr=0.1,0.1",), SWEEP_TRAIN, "lists a value twice"),
    (("lr=0.1", "lr=0.2"), SWEEP_TRAIN, "lr is given twice"),
    (("model=../x",), SWEEP_TRAIN, "cannot be part of a run directory's name"),
    (("model=a\nb",), SWEEP_TRAIN, "cannot be part of a run directory's name"),
    (("lr=abc",), SWEEP_TRAIN, "--sweep --lr: 'abc' is not a number"),
    (("epochs=2.5",), SWEEP_TRAIN, "'2.5' is not a whole number"),
    (("epochs=0",), SWEEP_TRAIN, "--epochs 0 must be a whole number of at least 1"),
    (("shuffle=maybe",), SWEEP_TRAIN, "'maybe' is not true or false"),
    (("lr=0.1",), ["hostname"], "the command must be `train ...`, not 'hostname'"),
    (("lr=0.1",), ["train", "--data", "d"], "needs --run-dir RUN in the train command"),
])
def test_bad_sweeps_are_refused_saying_why(sweep: tuple, command: list, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        SubmitConfig(sweep=sweep)
        sweep_elements(sweep, command)
    assert needle in str(info.value)


def test_cli_bad_sweep_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    for args in (["--sweep", "lr=", "--", *SWEEP_TRAIN], ["--sweep", "lr=1", "--", "hostname"],
                 ["--max-parallel", "2", "--", *SWEEP_TRAIN], ["--sweep", "lr=1", "--max-parallel", "0", "--", *SWEEP_TRAIN]):
        result = runner.invoke(make_app(), ["submit", "--folder", str(folder), "--cpus-per-task", "1", *args])
        assert result.exit_code == 2 and result.output.count("\n") == 1 and "error: " in result.output, result.output
    assert not folder.exists()


def test_dry_run_json_lists_the_elements_and_the_script_names_their_file(tmp_path: Path) -> None:
    args = ["submit", "--dry-run", "--json", "--folder", str(tmp_path), "--cpus-per-task", "1", "--sweep", "lr=0.1,0.2",
            "--max-parallel", "1", "--", *SWEEP_TRAIN]
    result = runner.invoke(make_app(), args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["elements"] == [{"task": 0, "run_dir": "runs/s/lr=0.1", "params": {"lr": "0.1"}},
                               {"task": 1, "run_dir": "runs/s/lr=0.2", "params": {"lr": "0.2"}}]
    argv = command_argv(out["script"])
    assert argv[argv.index("--sweep") + 1] == str(sweep_file(tmp_path, sweep_elements(("lr=0.1,0.2",), SWEEP_TRAIN)))
    assert "#SBATCH --array=0-1%1" in out["script"] and f"--output {tmp_path}/%A_%a_%t_log.out" in out["script"]
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


ARGV_TO_FILE = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"


def array_element_env(monkeypatch: pytest.MonkeyPatch, array: str, task: int, own_id: str) -> None:
    """The environment Slurm gives the batch shell of element TASK of job array ARRAY (own_id: its own job id)."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", own_id)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", array)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))


def test_the_supervisor_of_an_array_element_runs_its_combination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elements = sweep_elements(("lr=0.1,0.2,0.3",), SWEEP_TRAIN)
    path = write_sweep_file(tmp_path, elements)
    assert path == sweep_file(tmp_path, elements)
    out = tmp_path / "argv.json"
    array_element_env(monkeypatch, "8001", 1, own_id="8003")
    code = supervise(tmp_path, [sys.executable, "-c", ARGV_TO_FILE, str(out), "base"], max_requeues=1,
                     signal_delay_s=60, sweep=path)
    assert code == 0 and json.loads(out.read_text()) == ["base", *elements[1]["args"]]
    assert job_status(tmp_path, "8001_1")["state"] == "completed"  # the record is the element's: JOBID_TASK
    assert record_path(tmp_path, "8001_1").exists() and not record_path(tmp_path, "8003").exists()
    array_element_env(monkeypatch, "8001", 7, own_id="8010")  # an index the sweep file does not have
    assert supervise(tmp_path, ["true"], max_requeues=1, signal_delay_s=60, sweep=path) == 2
    status = job_status(tmp_path, "8001_7")
    assert status["state"] == "failed" and "no arguments for array element 7" in status["events"][-1]["note"]


def write_array_meta(folder: Path, job: str, n: int) -> list[dict]:
    elements = [{"job_id": f"{job}_{i}", "task": i, "run_dir": f"runs/s/lr={i}", "params": {"lr": str(i)}}
                for i in range(n)]
    meta_path(folder, job).write_text(json.dumps({"job_id": job, "submitted_at": 0, "command": SWEEP_TRAIN,
                                                  "run_dir": "runs/s", "elements": elements}))
    return elements


def test_an_array_s_state_is_made_of_its_elements_records(tmp_path: Path) -> None:
    write_array_meta(tmp_path, "9100", 3)
    for task, last in ((0, "completed"), (1, "completed"), (2, "completed")):
        record(tmp_path, f"9100_{task}", "start", restart=0)
        record(tmp_path, f"9100_{task}", last, restart=0, exit_code=0)
    status = job_status(tmp_path, "9100")
    assert status["array"] and status["state"] == "completed" and status["counts"] == {"completed": 3}
    record(tmp_path, "9100_1", "start", restart=1)  # a later attempt of element 1 fails
    record(tmp_path, "9100_1", "failed", restart=1, exit_code=5, rank=0)
    status = job_status(tmp_path, "9100")
    assert status["state"] == "failed" and status["exit_code"] == 5, status
    assert [e["state"] for e in status["elements"]] == ["completed", "failed", "completed"]
    assert job_status(tmp_path, "9100_1")["state"] == "failed"  # one element alone


def test_an_array_s_pending_and_running_elements_come_from_one_scontrol(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a FAKE scontrol printing what Slurm lists for an array: a line per element that started, one
    for those still pending (ArrayTaskId=1-2%1)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\n"
        "echo 'JobId=9201 ArrayJobId=9200 ArrayTaskId=0 JobName=hpctrain JobState=RUNNING Restarts=0 ExitCode=0:0'\n"
        "echo 'JobId=9200 ArrayJobId=9200 ArrayTaskId=1-2%1 JobName=hpctrain JobState=PENDING Restarts=0 ExitCode=0:0'\n")
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    write_array_meta(tmp_path, "9200", 3)
    record(tmp_path, "9200_0", "start", restart=0)
    status = job_status(tmp_path, "9200")
    assert [e["state"] for e in status["elements"]] == ["running", "pending", "pending"]
    assert status["state"] == "running" and status["counts"] == {"running": 1, "pending": 2}
    assert array_tasks("1-2%1") == [1, 2] and array_tasks("0,4-5") == [0, 4, 5] and array_tasks("3") == [3]


def test_status_jobs_and_logs_of_an_array_from_the_cli(tmp_path: Path) -> None:
    write_array_meta(tmp_path, "9300", 2)
    for task in (0, 1):
        record(tmp_path, f"9300_{task}", "start", restart=0)
        record(tmp_path, f"9300_{task}", "completed", restart=0, exit_code=0)
    result = runner.invoke(make_app(), ["status", "9300", "--folder", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "job 9300: completed (2 completed)"
    assert lines[1].split() == ["9300_0", "completed", "runs/s/lr=0"] and lines[2].split()[0] == "9300_1"
    result = runner.invoke(make_app(), ["status", "9300_1", "--folder", str(tmp_path), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["state"] == "completed"
    result = runner.invoke(make_app(), ["jobs", "--folder", str(tmp_path)])
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.splitlines()] == ["9300", "9300_0", "9300_1"]
    result = runner.invoke(make_app(), ["logs", "9300", "--folder", str(tmp_path)])
    assert result.exit_code == 2 and "is a job array (a sweep): name one element, e.g. `hpctrain logs 9300_0`" in result.output
