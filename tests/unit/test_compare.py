"""`hpctrain report RUN1 RUN2 ...`: real runs and hand-built run dirs compared, the best run and its criterion,
each run's status (finished, stopped, running, failed, missing), and the errors that leave nothing written."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from conftest import PYTHON, hpctrain, mpi_env
from hpctrain.base.errors import DataError
from hpctrain.cli.report import report as report_cmd
from hpctrain.tools.compare import COMPARE_FILES, compare_runs
from hpctrain.tools.runstatus import HEARTBEAT_STALE_S, run_status
from hpctrain.tools.report import PLOTS, load_run

app = typer.Typer()
app.command()(report_cmd)
runner = CliRunner()

LRS = ("0.02", "0.2")


def assert_png(path: Path) -> None:
    """A whole PNG (signature, IHDR, every pixel decodes) that is not blank."""
    import matplotlib.image

    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    pixels = matplotlib.image.imread(path)  # decodes the whole image: catches a truncated file
    assert pixels.shape[:2] == (height, width) and pixels.std() > 0.05, f"{path} looks blank"


def table(md: str) -> dict[str, list[str]]:
    """The rows of compare.md's table, by run name (without the backticks and the best mark)."""
    rows = {}
    for line in md.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].split("`")[1]] = cells[1:]
    return rows


def make_run(root: Path, name: str, metrics: list[dict], summary: dict | None = None,
             logs: dict[str, str] | None = None) -> Path:
    """A run dir written by hand: metrics.jsonl lines, maybe summary.json and files under logs/."""
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    for file, text in (logs or {}).items():
        (run / "logs").mkdir(exist_ok=True)
        (run / "logs" / file).write_text(text)
    return run


def epoch_end(step: int, loss: float, **val: float) -> dict:
    return {"step": step, "epoch": 0, "loss": loss, "samples_per_s": 1000.0 + step, **val}


def log_line(rank: int, level: str, message: str) -> str:
    """A line as the trainer's rank log writes it (runlog.setup_logging's format)."""
    return f"2026-01-01 00:00:00,000 rank {rank} {level} {message}\n"


def start_line(rank: int, world: int) -> str:
    return log_line(rank, "INFO", f"world {world}, rank {rank}, local rank {rank}, pid 1, host h, launcher mpirun, "
                                  "device cpu, torch threads 1")


# -- real runs -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep(digits2: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two real one-rank runs named as a sweep names them (2 epochs each); read-only for tests."""
    root = tmp_path_factory.mktemp("sweep")
    runs = []
    for lr in LRS:
        run = root / f"lr={lr}_batch_size=32"
        hpctrain(["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "2", "--lr", lr,
                  "--batch-size", "32", "--log-every", "5", "--json"], timeout=180)
        runs.append(run)
    return runs


@pytest.mark.slow
def test_compare_real_runs_and_a_missing_one(sweep: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "lr=1.0_batch_size=32"  # a sweep element that never started
    empty.mkdir()
    out = tmp_path / "out"
    result = runner.invoke(app, [*map(str, sweep), str(empty), "-o", str(out)])
    assert result.exit_code == 0, result.output
    summaries = [json.loads((run / "summary.json").read_text()) for run in sweep]
    best = max(range(len(sweep)), key=lambda i: summaries[i]["val_accuracy"])
    assert f"best run: {sweep[best].name} by highest val_accuracy ({summaries[best]['val_accuracy']:.4f}" \
        in result.output
    assert f"missing (no logged step): {empty.name}" in result.output
    assert str(out / "compare.md") in result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(COMPARE_FILES.values())
    assert_png(out / "compare.png")

    saved = json.loads((out / "compare.json").read_text())
    assert saved["best"] == sweep[best].name and saved["criterion"] == "val_accuracy"
    assert [r["name"] for r in saved["runs"]] == [run.name for run in sweep] + [empty.name]
    for row, summ in zip(saved["runs"], summaries):
        assert row["status"] == "finished"
        for key in ("steps", "train_loss", "val_loss", "val_accuracy", "samples_per_s", "train_time_s", "param_sha256"):
            assert row[key] == summ[key], key
    assert saved["runs"][2]["status"] == "missing" and "metrics.jsonl" in saved["runs"][2]["why"]
    assert saved["files"]["plot"] == str(out / "compare.png")

    md = (out / "compare.md").read_text()
    rows = table(md)
    assert f"**Best run: `{sweep[best].name}`**, by highest val_accuracy" in md
    for run, summ in zip(sweep, summaries):
        status, steps, train_loss, val_loss, val_accuracy, _, _, sha = rows[run.name]
        assert (status, steps, val_accuracy, sha) == ("finished", str(summ["steps"]), f"{summ['val_accuracy']:.4f}",
                                                      f"`{summ['param_sha256'][:12]}`")
        assert (train_loss, val_loss) == (f"{summ['train_loss']:.4f}", f"{summ['val_loss']:.4f}")
    assert rows[empty.name][0] == "missing" and set(rows[empty.name][1:]) == {""}
    assert f"- `{empty.name}` missing: no " in md


@pytest.mark.slow
def test_one_run_is_reported_as_before(sweep: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, [str(sweep[0]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {out / 'report.md'} and {len(PLOTS)} plots in {out}"
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOTS.values(), "report.md"])
    assert "# Run report:" in (out / "report.md").read_text()


@pytest.mark.mpi
@pytest.mark.slow
def test_a_real_run_running_then_stopped(digits2: Path, sweep: list[Path], tmp_path: Path) -> None:
    run = tmp_path / "long"
    proc = subprocess.Popen([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--", "train", "--data", str(digits2),
                             "--run-dir", str(run), "--epochs", "50", "--batch-size", "8", "--log-every", "5"],
                            env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2
                   and len(list((run / "logs").glob("*.heartbeat"))) == 2):  # the watchdogs beat once a second
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "no step logged in 120 s"
            time.sleep(0.05)
        going = compare_runs([sweep[0], run], tmp_path / "out")
        assert going["runs"][1]["status"] == "running", going["runs"][1]
        assert going["runs"][1]["why"].startswith("heartbeat ") and going["runs"][1]["steps"] >= 10
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    stopped = compare_runs([sweep[0], run], tmp_path / "out")["runs"][1]
    assert stopped["status"] == "stopped" and "--resume auto" in stopped["why"], stopped
    assert stopped["steps"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert table((tmp_path / "out" / "compare.md").read_text())["long"][0] == "stopped"


# -- hand-built runs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "vals, criterion, best",
    [
        # every run has a val_accuracy: the highest wins, even over a lower val_loss
        ([dict(val_loss=0.5, val_accuracy=0.80), dict(val_loss=0.4, val_accuracy=0.70), dict(val_loss=0.9, val_accuracy=0.90)],
         "val_accuracy", "c"),
        # one has no val_accuracy: the lowest val_loss
        ([dict(val_loss=0.5, val_accuracy=0.80), dict(val_loss=0.4), dict(val_loss=0.9, val_accuracy=0.90)], "val_loss", "b"),
        # one has no validation at all: the lowest final train loss
        ([dict(val_loss=0.5, val_accuracy=0.80), {}, dict(val_loss=0.9, val_accuracy=0.90)], "train_loss", "a"),
        # a diverged run (NaN) is never best; equal figures: the first given
        ([dict(val_loss=math.nan), dict(val_loss=0.3), dict(val_loss=0.3)], "val_loss", "b"),
    ],
)
def test_best_run_and_criterion(tmp_path: Path, vals: list[dict], criterion: str, best: str) -> None:
    losses = {"a": 0.1, "b": 0.2, "c": 0.3}
    runs = [make_run(tmp_path, name, [epoch_end(10, losses[name] + 1), epoch_end(20, losses[name], **v)])
            for name, v in zip("abc", vals)]
    result = compare_runs(runs, tmp_path / "out")
    assert (result["best"], result["criterion"]) == (best, criterion)
    assert result["criterion_text"].startswith(("highest " if criterion == "val_accuracy" else "lowest ") + criterion)
    md = (tmp_path / "out" / "compare.md").read_text()
    assert f"**Best run: `{best}`**, by {result['criterion_text']}." in md
    assert f"`{best}` **(best)**" in md and md.count("**(best)**") == 1
    assert_png(tmp_path / "out" / "compare.png")


def test_rows_of_unfinished_runs_are_their_figures_so_far(tmp_path: Path) -> None:
    metrics = [epoch_end(5, 2.0), epoch_end(10, 1.5, val_loss=1.2, val_accuracy=0.6, epoch_train_loss=1.7),
               epoch_end(15, 1.1)]
    finished = make_run(tmp_path, "done", metrics, summary={
        "steps": 15, "train_loss": 1.3, "val_loss": 1.0, "val_accuracy": 0.65, "samples_per_s": 1234.5,
        "train_time_s": 12.5, "param_sha256": "ab" * 32})
    going = make_run(tmp_path, "going", metrics)
    rows = {r["name"]: r for r in compare_runs([finished, going], tmp_path / "out")["runs"]}
    assert rows["done"]["status"] == "finished" and rows["done"]["samples_per_s"] == 1234.5
    assert rows["going"]["status"] == "running"
    assert (rows["going"]["steps"], rows["going"]["train_loss"], rows["going"]["val_loss"],
            rows["going"]["val_accuracy"], rows["going"]["samples_per_s"]) == (15, 1.1, 1.2, 0.6, 1010.0)
    assert rows["going"]["train_time_s"] is None and rows["going"]["param_sha256"] is None
    md_rows = table((tmp_path / "out" / "compare.md").read_text())
    assert md_rows["done"] == ["finished", "15", "1.3000", "1.0000", "0.6500", "1,234", "12.5", f"`{'ab' * 6}`"]
    assert md_rows["going"] == ["running", "15", "1.1000", "1.2000", "0.6000", "1,010", "", ""]


def status_of(tmp_path: Path, logs: dict[str, str], summary: dict | None = None, now: float | None = None,
              metrics: list[dict] | None = None) -> tuple[str, str]:
    run = make_run(tmp_path, "run", metrics or [epoch_end(5, 2.0), epoch_end(10, 1.0)], summary, logs)
    return run_status(load_run(run), now)


def test_status_finished_and_a_summary_of_an_earlier_run(tmp_path: Path) -> None:
    assert status_of(tmp_path / "a", {}, summary={"steps": 10})[0] == "finished"
    assert status_of(tmp_path / "b", {}, summary={"steps": 99})[0] == "running"  # another run's summary


def test_status_stopped_and_failed_from_the_rank_logs(tmp_path: Path) -> None:
    stop = log_line(1, "WARNING", "stopped by SIGTERM at step 10; checkpoint written")
    status, why = status_of(tmp_path / "stop", {"rank-0000.log": start_line(0, 2), "rank-0001.log": start_line(1, 2) + stop})
    assert status == "stopped" and why.startswith("stopped by SIGTERM at step 10") and "--resume auto" in why
    failed = log_line(0, "ERROR", "training failed") + "Traceback (most recent call last):\n  ...\nOSError: disk full\n"
    status, why = status_of(tmp_path / "fail", {"rank-0000.log": start_line(0, 1) + failed})
    assert (status, why) == ("failed", "training failed: OSError: disk full")
    alone = log_line(1, "ERROR", "rank 1: corrupt chunk in shard 3; ending the job")
    status, why = status_of(tmp_path / "alone", {"rank-0000.log": start_line(0, 2), "rank-0001.log": start_line(1, 2) + alone})
    assert status == "failed" and "corrupt chunk" in why
    hung = log_line(0, "ERROR", "rank 0: allreduce at step 10 has waited 301 s for rank 1 (no heartbeat); aborting the job")
    assert status_of(tmp_path / "hung", {"rank-0000.log": start_line(0, 2) + hung})[0] == "failed"


def test_status_of_a_resumed_run_is_its_latest_attempt(tmp_path: Path) -> None:
    """An earlier attempt's stop or failure (the log is appended to) does not make the resumed run stopped;
    nor does the log of a rank beyond the resumed run's world size."""
    beat = json.dumps({"rank": 0, "step": 10, "time": time.time()})
    old = start_line(0, 4) + log_line(0, "WARNING", "stopped by SIGUSR2 at step 5; checkpoint written")
    logs = {"rank-0000.log": old + start_line(0, 2), "rank-0001.log": start_line(1, 2),
            "rank-0003.log": start_line(3, 4) + log_line(3, "ERROR", "training failed"),
            "rank-0000.heartbeat": beat, "rank-0001.heartbeat": beat}
    assert status_of(tmp_path, logs)[0] == "running"


def test_status_from_heartbeats(tmp_path: Path) -> None:
    now = time.time()
    logs = {"rank-0000.log": start_line(0, 2), "rank-0001.log": start_line(1, 2),
            "rank-0000.heartbeat": json.dumps({"rank": 0, "step": 10, "time": now - 3}),
            "rank-0001.heartbeat": json.dumps({"rank": 1, "step": 10, "time": now - 4})}
    assert status_of(tmp_path / "a", logs, now=now) == ("running", "heartbeat 3 s ago")
    status, why = status_of(tmp_path / "b", logs, now=now + HEARTBEAT_STALE_S + 60)  # killed: beats left behind
    assert status == "failed" and "no heartbeat for" in why
    # every rank exited (each removes its heartbeat) with no summary, stop or logged error
    quiet = {k: v for k, v in logs.items() if k.endswith(".log")}
    assert status_of(tmp_path / "c", quiet, now=now + HEARTBEAT_STALE_S + 60)[0] == "failed"
    assert status_of(tmp_path / "d", quiet, now=now)[0] == "running"  # just starting: no beat written yet
    assert status_of(tmp_path / "e", quiet, now=now + 60)[0] == "failed"  # an error every rank agreed on


def test_a_one_rank_run_without_a_summary_is_running_with_its_age(tmp_path: Path) -> None:
    status, why = status_of(tmp_path, {"rank-0000.log": start_line(0, 1)}, now=time.time() + 600)
    idle = re.fullmatch(r"no summary.json yet; last written (\d+) s ago", why)
    assert status == "running" and idle and 590 <= int(idle.group(1)) <= 600, why


def test_names_that_clash_get_their_path(tmp_path: Path) -> None:
    runs = [make_run(tmp_path / group, "lr=0.1", [epoch_end(5, loss)]) for group, loss in (("x", 1.0), ("y", 0.5))]
    result = compare_runs(runs, tmp_path / "out")
    assert [r["name"] for r in result["runs"]] == ["x/lr=0.1", "y/lr=0.1"] and result["best"] == "y/lr=0.1"


def test_all_missing_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DataError, match="none of the 2 run directories has a logged step"):
        compare_runs([tmp_path / "empty", tmp_path / "nope"], tmp_path / "out")
    result = runner.invoke(app, [str(tmp_path / "empty"), str(tmp_path / "nope"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "pass the --run-dir of `hpctrain train` runs that have logged at least one step" in result.output
    assert "does not exist" in result.output and "metrics.jsonl" in result.output  # why, per run
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "args, needle",
    [
        (["a", "b"], "pass -o DIR"),
        (["a", "a", "-o", "out"], "is passed twice"),
        (["a", "b", "-o", "file"], "is a file"),
    ],
)
def test_bad_input(tmp_path: Path, args: list[str], needle: str) -> None:
    for name in ("a", "b"):
        make_run(tmp_path, name, [epoch_end(5, 1.0)])
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    result = runner.invoke(app, [str(tmp_path / a) if not a.startswith("-") else a for a in args])
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output, result.output
    assert sorted(tmp_path.rglob("*")) == before


def test_library_signature_stays(tmp_path: Path) -> None:
    """Others call compare_runs after a sweep: its signature and the keys of its result are an interface."""
    assert list(inspect.signature(compare_runs).parameters) == ["run_dirs", "out_dir"]
    result = compare_runs([make_run(tmp_path, "a", [epoch_end(5, 1.0)]), make_run(tmp_path, "b", [epoch_end(5, 2.0)])],
                          tmp_path / "out")
    assert {"best", "criterion", "runs", "files"} <= set(result)
    assert all(path.is_file() for path in result["files"].values())
    assert json.loads(result["files"]["json"].read_text())["runs"] == result["runs"]


def test_comparing_does_not_import_torch(tmp_path: Path) -> None:
    """It runs on a login node in a second or two: matplotlib, not torch."""
    runs = [make_run(tmp_path, name, [epoch_end(5, 1.0, val_loss=0.5)]) for name in ("a", "b")]
    code = ("import sys; from hpctrain.tools.compare import compare_runs; "
            f"compare_runs([{str(runs[0])!r}, {str(runs[1])!r}], {str(tmp_path / 'out')!r}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "False" and (tmp_path / "out" / "compare.png").is_file()
