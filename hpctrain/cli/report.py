"""`hpctrain report`: plots and a markdown summary of a run directory (finished or still running), or a
comparison of several."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..base.errors import ConfigError
from .common import handle_errors


@handle_errors
def report(
    runs: Annotated[list[Path], typer.Argument(help="Run directories written by `hpctrain train` (--run-dir); "
                                               "several: compare them.", metavar="RUN", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Where to write the PNGs and report.md "
                                                "(default: RUN/report); with several runs, where to write "
                                                "compare.png, compare.md and compare.json (required).")] = None,
) -> None:
    """Plot loss, validation accuracy, throughput and per-rank compute/communication/data time; write report.md.
    A traced run (--trace) adds the straggler verdict and every rank's phase times; a run that hung or failed
    gets its ranks' flight records lined up: the collective where they diverge, and who never arrived.
    With several runs: one plot of their loss and validation over steps, one table of their final figures,
    and the best run named.

    Works on runs that are still training: run it again to refresh.

    Example: hpctrain report runs/a -o runs/a/report

    Example: hpctrain report runs/sweep/lr=* -o runs/sweep/compare
    """
    if len(runs) == 1:
        from ..tools.report import report as write_report

        written = write_report(runs[0], out)
        plots = [p for p in written.values() if isinstance(p, Path) and p.suffix == ".png"]
        print(f"wrote {written['report']} and {len(plots)} plots in {written['report'].parent}")
        for finding in written["findings"]:  # the straggler verdict (--trace), a hang's flight records lined up
            print(finding)
        return
    if out is None:
        raise ConfigError(f"{len(runs)} runs to compare: pass -o DIR for compare.png, compare.md and compare.json")
    from ..tools.compare import compare_runs

    result = compare_runs(runs, out)
    files = result["files"]
    print(f"wrote {files['table']}, {files['json'].name} and {files['plot'].name} in {files['table'].parent}")
    missing = [r["name"] for r in result["runs"] if r["status"] == "missing"]
    if missing:
        print(f"missing (no logged step): {', '.join(missing)}")
    print(f"best run: {result['best']} by {result['criterion_text']}" if result["best"] else
          f"no best run: {result['criterion_text']}")
