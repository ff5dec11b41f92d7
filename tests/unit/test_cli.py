"""The CLI as users meet it: help text with examples, cheap start-up, and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpctrain.cli.main import app

runner = CliRunner()
COMMANDS = [["shard"], ["verify"], ["train"], ["launch"], ["doctor"], ["report"], ["container", "recipe"],
            ["container", "build"], ["bench", "allreduce"], ["bench", "train"], ["bench", "data"], ["submit"],
            ["jobs"], ["status"], ["logs"], ["cancel"]]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_an_example(cmd: list[str]) -> None:
    result = runner.invoke(app, [*cmd, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output


def test_cli_import_does_not_pull_torch_or_mpi() -> None:
    code = "import sys, hpctrain.cli.main; print('torch' in sys.modules, 'mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("c") / "d"
    assert runner.invoke(app, ["shard", "synthetic:64:5:3", str(out), "--shards", "2"]).exit_code == 0
    return out


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "--data is required"),
        (["--data", "{data}"], "--run-dir is required"),
        (["--data", "{tmp}/nope", "--run-dir", "{run}"], "does not exist"),
        (["--data", "{tmp}", "--run-dir", "{run}"], "manifest.json"),
        (["--data", "{data}", "--run-dir", "{run}", "--model", "resnet9000"], "unknown model"),
        (["--data", "{data}", "--run-dir", "{run}", "--model", "no_such_module:build"], "cannot import module"),
        (["--data", "{data}", "--run-dir", "{run}", "--model", "{tmp}/m.py:build"], "not found"),
        (["--data", "{data}", "--run-dir", "{run}", "--model", "mlp:64:dropout=2"], "dropout"),
        (["--data", "{data}", "--run-dir", "{run}", "--model", "cnn"], "cnn"),
        (["--data", "{data}", "--run-dir", "{run}", "--optimizer", "lion"], "sgd, adam, adamw"),
        (["--data", "{data}", "--run-dir", "{run}", "--schedule", "warp"], "constant, cosine, step"),
        (["--data", "{data}", "--run-dir", "{run}", "--compress", "int4"], "none, fp16, bf16"),
        (["--data", "{data}", "--run-dir", "{run}", "--lr", "-1"], "--lr"),
        (["--data", "{data}", "--run-dir", "{run}", "--batch-size", "0"], "--batch-size"),
        (["--data", "{data}", "--run-dir", "{run}", "--keep", "1"], "--keep"),
        (["--data", "{data}", "--run-dir", "{run}", "--init-weights", "{tmp}/w.pt"], "--init-weights"),
        (["--data", "{data}", "--run-dir", "{run}", "--resume", "{tmp}/ckpt"], "--resume"),
        (["--data", "{data}", "--run-dir", "{run}", "--config", "{tmp}/none.toml"], "--config"),
        (["--data", "{data}", "--run-dir", "{run}", "--config", "{bad_toml}"], "unknown key"),
        (["--data", "{data}", "--run-dir", "{run}", "--checkpoint-every", "often"], "--checkpoint-every"),
        (["--data", "{data}", "--run-dir", "{run}", "--accumulate", "0"], "--accumulate"),
        (["--data", "{data}", "--run-dir", "{run}", "--collective-timeout", "-5"], "--collective-timeout"),
        (["--data", "{data}", "--run-dir", "{run}", "--checkpoint-timeout", "-1"], "--checkpoint-timeout"),
        (["--data", "{data}", "--run-dir", "{run}", "--bucket-mb", "0"], "--bucket-mb"),
        (["--data", "{data}", "--run-dir", "{run}", "--tensorboard"], "tensorboard"),
        (["--data", "{data}", "--run-dir", "{run}", "--trace", "0:50"], "--trace '0:50': give a window of steps"),
    ],
)
def test_train_bad_input(data: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("learning_rate = 3\n")
    run = tmp_path / "run"
    args = [a.format(data=data, tmp=tmp_path, run=run, bad_toml=bad_toml) for a in args]
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output
    assert not run.exists()


def test_config_file_values_and_flags_win(data: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'data = "{data}"\nrun-dir = "{tmp_path / "r"}"\nmax_steps = 3\nlr = 0.01\nbatch_size = 8\n')
    result = runner.invoke(app, ["train", "--config", str(cfg), "--max-steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    resolved = (tmp_path / "r" / "config.toml").read_text()
    assert "max_steps = 2" in resolved and "lr = 0.01" in resolved and "batch_size = 8" in resolved


def test_launch_needs_a_command() -> None:
    result = runner.invoke(app, ["launch", "-n", "2"])
    assert result.exit_code == 2


def test_launch_rejects_zero_ranks() -> None:
    result = runner.invoke(app, ["launch", "-n", "0", "--", "hostname"])
    assert result.exit_code == 2 and "-n 0" in result.output


def test_launch_rejects_a_negative_grace() -> None:
    result = runner.invoke(app, ["launch", "-n", "2", "--grace", "-1", "--", "hostname"])
    assert result.exit_code == 2 and "--grace -1" in result.output


def test_launch_builds_the_mpirun_command() -> None:
    from hpctrain.tools.launch import build_command

    argv, env = build_command(4, ["train", "--data", "d"], mpirun="/usr/bin/mpirun", cpus=2, is_root=True, python="py")
    assert argv == ["/usr/bin/mpirun", "-n", "4", "--bind-to", "none", "--oversubscribe", "py", "-m", "hpctrain",
                    "train", "--data", "d"]
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    argv, env = build_command(2, ["hostname"], mpirun="mpirun", cpus=2, is_root=False)
    assert argv == ["mpirun", "-n", "2", "--bind-to", "none", "hostname"] and env == {}
    # hpctrain ranks start with the stop signals blocked; any other program is started as it is
    block = ("env", "--block-signal=TERM,USR2")
    argv, _ = build_command(2, ["train"], mpirun="mpirun", cpus=2, is_root=False, python="py", block=block)
    assert argv[-6:] == [*block, "py", "-m", "hpctrain", "train"]
    argv, _ = build_command(2, ["hostname"], mpirun="mpirun", cpus=2, is_root=False, block=block)
    assert argv[-1] == "hostname" and "env" not in argv


def test_block_prefix_blocks_the_stop_signals_across_exec() -> None:
    import signal
    import subprocess

    from hpctrain.tools.launch import catches
    from hpctrain.base.stop import block_prefix

    out = subprocess.run([*block_prefix(), "grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True)
    mask = int(out.stdout.split()[1], 16)
    assert mask >> (signal.SIGTERM - 1) & 1 and mask >> (signal.SIGUSR2 - 1) & 1, out.stdout
    sleeper = subprocess.Popen(["sleep", "5"])
    try:
        assert not catches(sleeper.pid, signal.SIGTERM)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("args,needle", [
    (["--epochz", "3"], "error: No such option: --epochz (Possible options: --epochs)"),
    (["--lr", "-1"], "error: --lr -1.0 must be a positive number"),
    (["--data", "nowhere"], "error: --data 'nowhere' does not exist"),
])
def test_launch_checks_train_s_arguments_once_before_mpirun_starts(data: Path, tmp_path: Path, args: list[str],
                                                                 needle: str) -> None:
    """Before: a usage box per rank, then a dozen lines of mpirun's; the shard count was checked only after
    every rank had started. Now the launcher parses and checks them itself: one line, no mpirun."""
    argv = ["launch", "-n", "3", "--", "train", "--data", str(data), "--run-dir", str(tmp_path / "r"), *args]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert needle in proc.stderr and not (tmp_path / "r").exists()


def test_launch_refuses_a_world_its_shards_cannot_divide_before_starting_it(data: Path, tmp_path: Path) -> None:
    argv = ["launch", "-n", "3", "--", "train", "--data", str(data), "--run-dir", str(tmp_path / "r")]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "holds 2 shards per split, and 3 ranks cannot share them evenly" in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert help_text.count("Usage: hpctrain train") == 1
