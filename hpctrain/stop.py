"""The stop request of a run: SIGTERM or SIGUSR2, from a scheduler, a launcher or a person.

A signal handler only sets a flag; the ranks agree on it at the next step boundary, write one checkpoint
together and exit with `STOP_EXIT`. There is one flag per process, installed as early as possible
(`python -m hpctrain train` does it before importing anything slow), so a stop that arrives while the
process is still starting is kept for the first step boundary instead of killing the rank (the default
action of SIGUSR2 is to terminate).
"""

from __future__ import annotations

import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
STOP_EXIT = 3  # every rank stopped at a step boundary and the checkpoint is written: resume with --resume auto


class StopFlag:
    """Set by SIGTERM/SIGUSR2 once installed; read at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> bool:
        """Route the stop signals to this flag; False when it already was (or when not in the main thread,
        where signals stay with the caller: library use)."""
        if self._previous:
            return False
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                return False
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def restore(self) -> None:
        """Give the signals back to their previous handlers, and forget the request."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.signum = None


FLAG = StopFlag()
