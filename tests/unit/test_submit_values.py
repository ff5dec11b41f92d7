"""Every value that reaches the batch script is refused when it holds a control character (#54 item 11).

A newline in `--account` used to become a line of its own in the script, where sbatch reads `#SBATCH ...` as a
directive: one check before rendering refuses it, whatever the value's way in (a flag, --env, --sweep, a path,
the command's arguments).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hpctrain.base.errors import ConfigError
from hpctrain.cli import submit as submit_cli
from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.render import batch_command, render_sbatch, sbatch_parameters

PY = "/opt/hpctrain/venv/bin/python"
TRAIN = ["train", "--data", "/scratch/data", "--run-dir", "/scratch/runs/a"]
INJECT = "acct\n#SBATCH --uid=0\necho x"

_APP = typer.Typer()
submit_cli.register(_APP)
runner = CliRunner()


def _config(**kwargs: object) -> SubmitConfig:
    return SubmitConfig(**{"folder": Path("/jobs"), "python": PY, "cpus_per_task": 1, **kwargs})


@pytest.mark.parametrize(
    "kwargs, command, needle",
    [
        (dict(account=INJECT), TRAIN, "--account"),
        (dict(partition="gpu\r\n#SBATCH --uid=0"), TRAIN, "--partition"),
        (dict(env=("NOTE=a\nb",)), TRAIN, "--env"),
        (dict(folder=Path("/jobs\n#SBATCH --uid=0")), TRAIN, "--folder"),
        (dict(container=Path("/img\x1b.sif")), TRAIN, "--container"),
        (dict(python="/usr/bin/python\tx"), TRAIN, "--python"),
        (dict(binds=("/a\nb",)), TRAIN, "--binds"),
        (dict(), [*TRAIN, "--model", "m\n#SBATCH --uid=0"], "COMMAND"),
        (dict(), ["train", "--data", "/d\x00", "--run-dir", "/r"], "COMMAND"),
    ],
)
def test_a_control_character_in_any_value_is_refused_before_the_script_is_written(
        kwargs: dict, command: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        render_sbatch(_config(**kwargs), command)
    message = str(info.value)
    assert needle in message and "control character" in message
    assert "\n" not in message  # the value is quoted escaped: the error is one line
    # the script's other entry points (submission calls them after rendering) check the same way
    with pytest.raises(ConfigError):
        sbatch_parameters(_config(**kwargs), command)
    with pytest.raises(ConfigError):
        batch_command(_config(**kwargs), command)


def test_a_sweep_value_with_a_control_character_is_refused() -> None:
    with pytest.raises(ConfigError, match="control character"):
        render_sbatch(_config(sweep=("lr=0.1,0.2\n#SBATCH --uid=0",)), TRAIN)


def test_printable_values_still_render_as_given() -> None:
    script = render_sbatch(_config(account="proj 42; $x", env=("NOTE=don't $panic",)), [*TRAIN, "--model", "a b"])
    assert "#SBATCH --account='proj 42; $x'" in script


def test_submit_refuses_an_injected_directive_in_one_line_with_exit_2(tmp_path: Path) -> None:
    args = ["submit", "--dry-run", "--folder", str(tmp_path / "jobs"), "--cpus-per-task", "1", "--account", INJECT,
            "--", *TRAIN]
    result = runner.invoke(_APP, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--account" in lines[0] and "control character" in lines[0], result.output
    assert "#SBATCH --cpus-per-task" not in result.output  # no script was printed
