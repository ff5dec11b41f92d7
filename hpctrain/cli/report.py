"""`hpctrain report`: plots and a markdown summary of a run directory (finished or still running)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import handle_errors


@handle_errors
def report(
    run: Annotated[Path, typer.Argument(help="A run directory written by `hpctrain train` (--run-dir).")],
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Where to write the PNGs and report.md "
                                                "(default: RUN/report).")] = None,
) -> None:
    """Plot loss, validation accuracy, throughput and per-rank compute/communication/data time; write report.md.

    Works on a run that is still training: run it again to refresh.

    Example: hpctrain report runs/a -o runs/a/report
    """
    from ..tools.report import report as write_report

    written = write_report(run, out)
    print(f"wrote {written['report']} and {len(written) - 1} plots in {written['report'].parent}")
