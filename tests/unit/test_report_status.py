"""`hpctrain report` says how a run without a summary ended, counts epochs as the console does, and reports a
library run's timeline (#54 item 10): a stopped, aborted or killed run was "in progress", epochs were numbered from 0
where the console counts from 1, and a run of your own loop with a timeline was refused for its missing
metrics.jsonl."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from conftest import PYTHON, mpi_env, mpirun
from hpctrain.cli.report import report as report_cmd

app = typer.Typer()
app.command()(report_cmd)
runner = CliRunner()


def _started(data: Path, run: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A one-process run of many epochs, once it has logged the end of its first epoch."""
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "train", "--data", str(data), "--run-dir", str(run), "--epochs",
                             "300", "--batch-size", "64", "--log-every", "5", "--checkpoint-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and any("val_loss" in line for line in metrics.read_text().splitlines()):
            return proc
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run logged no epoch end in 240 s")


def _report(run: Path) -> str:
    result = runner.invoke(app, [str(run)])
    assert result.exit_code == 0, result.output
    return (run / "report" / "report.md").read_text()


def test_a_stopped_run_is_stopped_and_its_epochs_count_as_the_console_does(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _started(digits2, run, mpi_env())  # a warm rank (tests/startup/warmranks.py): its stand-in passes it on
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    md = _report(run)
    assert "in progress" not in md, md
    assert re.search(r"\*\*Status: stopped\*\* \(stopped by SIGTERM at step \d+", md), md
    # the console's "epoch E step S/N" lines against the report's numbers
    console = {int(s): int(e) for e, s in re.findall(r"^epoch (\d+) step (\d+)/", out + err, re.M)}
    rows = {int(s): int(e) for e, s in re.findall(r"^\| (\d+) \| (\d+) \| ", md, re.M)}
    assert rows and all(console[s] == e for s, e in rows.items()), (console, rows)
    last = max(console)
    assert f"Last logged: step {last}, epoch {console[last]}," in md, md
    # the stop's record alone says so too (a log whose last lines were lost, or worded otherwise)
    log = run / "logs" / "rank-0000.log"
    log.write_text("".join(line for line in log.read_text().splitlines(True) if " WARNING stopped by " not in line))
    md = _report(run)
    assert re.search(r"\*\*Status: stopped\*\* \(stopped by SIGTERM at step \d+ \(asked by the scheduler\)", md), md


def test_a_killed_run_has_failed(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _started(digits2, run)  # cold: the report names the pid the run recorded, which is this process's
    proc.kill()  # no stop record, no error, no summary: only its process is gone
    proc.communicate(timeout=60)
    md = _report(run)
    assert "in progress" not in md and "**Status: failed**" in md, md
    assert f"its processes (pid {proc.pid} on " in md and ") are gone" in md, md


@pytest.mark.mpi
def test_an_aborted_run_has_failed_with_its_error(digits2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--max-steps", "50", "--log-every", "2",
                      "--collective-timeout", "5"], check=False, timeout=240, env=mpi_env(HPCTRAIN_TEST_HANG="1:5:0"))
    assert proc.returncode != 0
    md = _report(run)
    assert "in progress" not in md and "**Status: failed** (rank " in md and "aborting the job" in md, md


def test_a_library_runs_timeline_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    loop = ("import sys, time, hpctrain\n"
            "timeline = hpctrain.Timeline(sys.argv[1], '2:5')\n"
            "for step in range(1, 7):\n"
            "    timeline.step(step)\n"
            "    with timeline.span('forward'):\n"
            "        time.sleep(0.002)\n"
            "timeline.close()\n")
    subprocess.run([PYTHON, "-c", loop, str(run)], check=True, timeout=120)
    assert not (run / "metrics.jsonl").exists()
    result = runner.invoke(app, [str(run)])
    assert result.exit_code == 0, result.output
    assert "straggler: no straggler (one rank)" in result.output
    md = (run / "report" / "report.md").read_text()
    assert "No metrics.jsonl" in md and "## Timeline (--trace)" in md and "window 2:5: 4 steps" in md
