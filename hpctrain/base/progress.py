"""Progress display: a rich bar on an interactive terminal, one plain line now and then otherwise.

Slurm logs and CI are not terminals, so there a bar would print garbage; they get a short line every
`every` updates instead. Only rank 0 should create an enabled `Progress`.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """A progress display over `total` units; `update(n, **fields)` advances it."""

    def __init__(self, total: int, description: str, *, enabled: bool = True, stream: TextIO | None = None,
                 unit: str = "", plain_every_s: float = 10.0):
        self.total = max(0, int(total))
        self.description = description
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.unit = unit
        self.done = 0
        self.fields: dict[str, Any] = {}
        self._bar: Any = None
        self._task: Any = None
        self._plain_every = plain_every_s
        self._last_plain = 0.0
        self._start = time.perf_counter()
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=Console(file=self.stream), transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=self.total, info="")

    def update(self, advance: int = 1, **fields: Any) -> None:
        self.done += advance
        self.fields.update(fields)
        if not self.enabled:
            return
        info = "  ".join(f"{k} {v}" for k, v in self.fields.items())
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, info=info)
            return
        now = time.perf_counter()
        if now - self._last_plain >= self._plain_every or self.done >= self.total:
            self._last_plain = now
            print(f"{self.description}: {self.done}/{self.total} {self.unit} {info}".rstrip(), file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
