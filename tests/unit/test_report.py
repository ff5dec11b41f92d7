"""`hpctrain report` on a real 2-rank run: valid PNGs, a markdown summary, runs in progress, and bad input."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from conftest import mpirun
from hpctrain.cli.report import report as report_cmd
from hpctrain.tools.report import PLOTS, by_step, read_jsonl

app = typer.Typer()
app.command()(report_cmd)
runner = CliRunner()

RUN_FILES = ["metrics.jsonl", "summary.json", "config.toml", "logs/rank-0000.jsonl", "logs/rank-0001.jsonl"]
PNG_SIZES = {"loss": (700, 400), "accuracy": (700, 400), "throughput": (700, 400), "timing": (1000, 650)}


@pytest.fixture(scope="module")
def finished(digits2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the trainer on 2 MPI ranks (3 epochs, a log line every 5 steps); read-only for tests."""
    run = tmp_path_factory.mktemp("report") / "run"
    mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), "--epochs", "3", "--log-every", "5",
               "--json"], timeout=120)
    return run


def copy_run(src: Path, dst: Path, files: list[str] = RUN_FILES) -> Path:
    """The report's inputs of `src` in a fresh run dir, so a test can change them."""
    for name in files:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, dst / name)
    return dst


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def assert_plots(out: Path) -> None:
    import matplotlib.image

    for key, name in PLOTS.items():
        path = out / name
        assert png_size(path) == PNG_SIZES[key], path
        pixels = matplotlib.image.imread(path)  # decodes the whole image: catches a truncated file
        assert pixels.shape[:2] == PNG_SIZES[key][::-1] and pixels.std() > 0.05, f"{path} looks blank"


@pytest.mark.mpi
def test_report_of_a_finished_run(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, [str(finished), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out / "report.md") in result.output
    assert_plots(out)
    md = (out / "report.md").read_text()
    summary = json.loads((finished / "summary.json").read_text())
    assert "finished" in md and "in progress" not in md
    assert f"| val_accuracy | {summary['val_accuracy']:.4f} |" in md
    assert f"| world_size | {summary['world_size']} |" in md
    # the two throughput figures of one run, told apart (before: a median beside samples_per_s, unexplained)
    assert f"samples_per_s ({summary['samples_per_s']:,.0f}) is the whole run's" in md
    assert "the throughput plot's median (" in md
    note = summary["checkpoint"]["interval_note"]  # and the Young/Daly interval in words
    assert note.startswith("--checkpoint-every auto: every ") and "--mtbf-hours 24" in note
    for name in PLOTS.values():
        assert f"]({name})" in md
    epoch_rows = [line for line in md.splitlines() if line.startswith("| 2 | ")]
    assert len(epoch_rows) == 1  # the per-epoch table has the last epoch (the rank table only ranks 0 and 1)
    assert "| 0 | " in md and "| 1 | " in md and "comm share" in md


@pytest.mark.mpi
def test_default_out_is_run_report(finished: Path, tmp_path: Path) -> None:
    run = copy_run(finished, tmp_path / "run")
    result = runner.invoke(app, [str(run)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "report").iterdir()) == sorted([*PLOTS.values(), "report.md"])
    assert "](../config.toml)" in (run / "report" / "report.md").read_text()


@pytest.mark.mpi
def test_run_in_progress_with_a_partial_last_line(finished: Path, tmp_path: Path) -> None:
    run = copy_run(finished, tmp_path / "run", [f for f in RUN_FILES if f != "summary.json"])
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    # cut the last line mid-write (no newline), the way a reader can catch the trainer's append
    (run / "metrics.jsonl").write_text("\n".join(metrics[:-1]) + "\n" + metrics[-1][:25])
    for rank in (0, 1):
        path = run / "logs" / f"rank-{rank:04d}.jsonl"
        path.write_text(path.read_text()[:-40])
    result = runner.invoke(app, [str(run), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert_plots(tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    last_complete = json.loads(metrics[-2])
    assert "in progress" in md and f"step {last_complete['step']}," in md and "val_accuracy" in md


@pytest.mark.mpi
def test_summary_of_an_earlier_run_is_not_taken_for_this_one(finished: Path, tmp_path: Path) -> None:
    run = copy_run(finished, tmp_path / "run")  # as if the directory were reused by a new run, now at step 10
    (run / "metrics.jsonl").write_text((finished / "metrics.jsonl").read_text().splitlines()[1] + "\n")
    result = runner.invoke(app, [str(run)])
    assert result.exit_code == 0, result.output
    md = (run / "report" / "report.md").read_text()
    steps = json.loads((finished / "summary.json").read_text())["steps"]
    assert "in progress" in md and f"earlier run in this directory: {steps} steps" in md


@pytest.mark.mpi
def test_first_epoch_not_finished(finished: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text((finished / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    result = runner.invoke(app, [str(run)])
    assert result.exit_code == 0, result.output
    assert_plots(run / "report")  # the accuracy and timing plots say there is nothing yet
    md = (run / "report" / "report.md").read_text()
    assert "in progress" in md and "val_accuracy not measured yet" in md


@pytest.mark.parametrize(
    "setup, needle",
    [
        ("missing", "does not exist"),
        ("file", "is not a directory"),
        ("empty_dir", "metrics.jsonl"),
        ("only_partial_line", "no complete step yet"),
        ("corrupt_middle_line", "metrics.jsonl:2 is not valid JSON"),
        ("not_an_object", "metrics.jsonl:1 is not a JSON object"),
        ("bad_summary", "summary.json is not valid JSON"),
        ("out_is_a_file", "is a file"),
    ],
)
def test_bad_input(tmp_path: Path, setup: str, needle: str) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    line = json.dumps({"step": 5, "epoch": 0, "loss": 2.0, "samples_per_s": 100.0})
    if setup == "file":
        run.write_text("")
    elif setup != "missing":
        run.mkdir()
        metrics = {"empty_dir": None, "only_partial_line": line[:20], "not_an_object": "[1, 2]\n",
                   "corrupt_middle_line": f"{line}\n{{oops\n{line}\n"}.get(setup, line + "\n")
        if metrics is not None:
            (run / "metrics.jsonl").write_text(metrics)
    if setup == "bad_summary":
        (run / "summary.json").write_text("{")
    if setup == "out_is_a_file":
        out.write_text("")
    before = sorted(tmp_path.rglob("*"))
    result = runner.invoke(app, [str(run), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_read_jsonl_skips_only_an_unterminated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 3}\n\n{"step": 2, "loss": 2}\n{"step": 1, "loss": 1}\n{"step": 3, "lo')
    assert [(r["step"], r["loss"]) for r in by_step(read_jsonl(path))] == [(1, 1), (2, 2)]
    path.write_text('{"step": 1}\n{"step": 2}')  # complete but not yet terminated: kept
    assert len(read_jsonl(path)) == 2


def test_help_has_an_example_and_cli_import_stays_light() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "Example:" in result.output and "--out" in result.output
    code = "import sys, hpctrain.cli.report; print(any(m in sys.modules for m in ('matplotlib', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
