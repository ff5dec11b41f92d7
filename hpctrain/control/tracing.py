"""A run's timeline (`--trace WINDOW`, and `hpctrain.Timeline` for your own loop): the steps of the window recorded
on every rank, the clocks aligned, each rank's file written, and rank 0's merge into RUN/trace.json with the
straggler verdict for summary.json. Also the test hooks of the data path and of the collectives
(HPCTRAIN_TEST_STRAGGLER, HPCTRAIN_TEST_HANG: base/rankenv.py), which act with or without a trace.

The recording itself is in `hpctrain.trace`: the comm layer feeds the flight recorder, the phases of a step
(`control.step`), validation, checkpoints and staging record their spans, and this module marks where each
step begins (`batches`) and where the window's clocks are measured (its first step, and `close`).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..base.errors import ConfigError, HpctrainError
from ..base.rankenv import RankEnv, read_env
from ..base.window import Window, parse_window
from ..comm import Comm, world
from ..comm.clocks import clock_offsets
from ..trace.chrome import merge
from ..trace.flight import RECORDER
from ..trace.spans import TRACER
from .watchdog import waiting


def straggler_delay(hook: str | None, rank: int) -> float:
    """HPCTRAIN_TEST_STRAGGLER=RANK:SECONDS: the seconds this rank sleeps in its data path before each step."""
    if not hook:
        return 0.0
    try:
        who, seconds = hook.split(":")
        return float(seconds) if int(who) == rank else 0.0
    except ValueError:
        raise ConfigError(f"HPCTRAIN_TEST_STRAGGLER={hook!r} must be RANK:SECONDS, e.g. 3:0.02 (a test hook)") from None


def hang_point(hook: str | None, rank: int) -> tuple[int, int] | None:
    """HPCTRAIN_TEST_HANG=RANK:STEP:BUCKET: the (step, bucket) whose collective this rank never enters."""
    if not hook:
        return None
    try:
        who, step, bucket = (int(v) for v in hook.split(":"))
    except ValueError:
        raise ConfigError(f"HPCTRAIN_TEST_HANG={hook!r} must be RANK:STEP:BUCKET, e.g. 1:5:0 (a test hook)") from None
    return (step, bucket) if who == rank else None


def window_note(window: Window | None, done: int, last: int) -> str | None:
    """A line saying that `window` records no step of a run that goes from step `done` + 1 to `last` (its
    timeline would be empty, unsaid), or None. A warning, not a refusal: a run resumed past its window keeps
    its command (a requeued job reruns it as it was)."""
    if window is None:
        return None
    if window.kind == "range":
        empty = window.a > last or window.b <= done
    elif window.kind == "every":
        empty = last // window.a * window.a <= done
    else:
        empty = last <= done
    if not empty:
        return None
    return (f"--trace {window} records no step of this run (steps {done + 1} to {last}): its timeline will be empty; "
            f"give a window of those steps, e.g. --trace last:{max(1, min(20, last - done))}")


class Timeline:
    """One rank's timeline of `run_dir` over `window` (None: no trace, only the test hooks). Collective: make it,
    mark the steps (`batches` or `step`), and `close` it on every rank.

    `hpctrain train --trace` makes one; in your own loop:

        timeline = hpctrain.Timeline("runs/a", "10:30")
        for step, (x, y) in enumerate(loader, start=1):
            timeline.step(step)
            with timeline.span("forward"):
                loss = loss_fn(model(x), y)
            ...
        timeline.close()  # RUN/trace.json, and the straggler verdict on rank 0
    """

    def __init__(self, run_dir: str | Path, window: str | None, comm: Comm | None = None, *,
                 env: RankEnv | None = None, watchdog: Any = None):
        self.comm = comm or world()
        self.run_dir, self.watchdog = Path(run_dir), watchdog
        env = env or read_env()
        self.delay = straggler_delay(env.test_straggler, self.comm.rank)
        RECORDER.hang = hang_point(env.test_hang, self.comm.rank)
        self.window = parse_window(window) if window else None
        self.path = self.run_dir / "trace" / f"rank-{self.comm.rank:04d}.json"
        self.closed = self.window is None
        self._clocked = False
        if self.window is not None:
            self.path.unlink(missing_ok=True)  # an earlier run's
            TRACER.start(self.window, self.comm.rank)
            RECORDER.dumpers.append(self._dump)

    def warn_outside(self, done: int, last: int, log: logging.Logger) -> None:
        """Say (rank 0's stderr, every rank's log) when the window records no step of a run from step `done` + 1
        to `last` (see `window_note`)."""
        note = window_note(self.window, done, last)
        if note is None:
            return
        log.warning(note)
        if self.comm.rank == 0:
            print(f"warning: {note}", file=sys.stderr)

    def batches(self, batches: Iterator[Any], done: int) -> Iterator[Any]:
        """`batches` of the steps after step `done`, each step marked, its wait for data recorded (and slowed by
        the straggler hook); the first measures the clocks (collective: every rank runs the same steps)."""
        if self.window is None and not self.delay:
            return batches
        return self._steps(batches, done)

    def _steps(self, batches: Iterator[Any], step: int) -> Iterator[Any]:
        try:
            while True:
                start = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if self.delay:
                    time.sleep(self.delay)
                end, step = time.perf_counter(), step + 1
                self.step(step)
                TRACER.span("data wait", start, end)
                yield batch
        finally:
            batches.close()

    def step(self, step: int) -> None:
        """Step `step` (1-based) begins; the first one measures the clocks (collective)."""
        if self.window is None:
            return
        if not self._clocked:
            self._clocked = True
            self._clock("")
        TRACER.begin_step(step)

    def span(self, name: str, **args: Any) -> Any:
        """`with timeline.span("forward"):` records the block as a span of the current step."""
        return TRACER.timed(name, **args)

    def _clock(self, which: str) -> None:
        """Measure this rank's clock against rank 0's (collective): `offset`, `error` and `at`, suffixed."""
        with waiting(self.watchdog, "clock alignment (--trace)"):
            measured = clock_offsets(self.comm)
        TRACER.clock.update({k + which: v for k, v in measured.items()})

    def close(self) -> dict[str, Any]:
        """End the timeline on every rank (collective): measure the clocks again, write this rank's file, and on
        rank 0 merge every rank's into RUN/trace.json. Returns summary.json's `trace` and `straggler` entries
        on rank 0 ({} elsewhere, and without a window)."""
        if self.closed:
            return {}
        self.closed = True
        if not self._clocked:  # no step ran: still every rank's clock, once
            self._clocked = True
            self._clock("")
        self._clock("_end")
        error = None
        try:
            TRACER.write(self.path)
        except OSError as exc:
            error = HpctrainError(f"rank {self.comm.rank}: cannot write its timeline {self.path}: {exc}")
        self._forget()
        with waiting(self.watchdog, "timeline files (--trace)"):
            self.comm.agree(error)
        return merge(self.run_dir) if self.comm.rank == 0 else {}

    def abandon(self) -> None:
        """The run ends another way (a stop, an error): this rank's file as far as it got, no collective;
        `hpctrain report` merges what the ranks left."""
        if not self.closed:
            self.closed = True
            try:
                TRACER.write(self.path)
            except OSError:
                pass
            self._forget()
        RECORDER.hang = None

    def _dump(self, reason: str) -> None:
        TRACER.write(self.path, close=False)

    def _forget(self) -> None:
        TRACER.start(None)
        if self._dump in RECORDER.dumpers:
            RECORDER.dumpers.remove(self._dump)
