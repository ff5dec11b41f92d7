"""A hang watchdog: no job waits forever in a collective.

The trainer names each wait that depends on other ranks around it (`with watchdog.waiting("gradient
allreduce", step):`); each phase has its own budget: collectives the
collective timeout, a checkpoint write (which waits for the slowest rank's part on a parallel filesystem)
the checkpoint timeout. Work that waits for nobody (validation compute, the summary) is not watched, so a
long validation never aborts a healthy job; a rank stuck in it is seen by the others, who wait for it in
the next collective. A thread on every rank writes a heartbeat file once a second
(`RUN/logs/rank-NNNN.heartbeat`: step, phase, time) and, when the current collective has waited longer than
the timeout, reads the other ranks' heartbeats to say which ranks it is waiting for (behind, or silent: dead
or stuck), logs that on stderr and in the rank's log, and aborts the whole job through MPI. The run
directory is on a filesystem every rank sees, as on any cluster.

The thread also notices when its own process did not run for a while (stopped, or starved of CPU: its sleep
took seconds longer than asked), and says so in the heartbeat and the flight record. Before it aborts, and
whenever a wait has taken half its budget (so that every rank stuck in the same
collective has dumped by the time the first one fires), the thread dumps the flight recorder of
collectives (RUN/logs/rank-NNNN.flight.json); rank 0 lines up the dumps it finds in its abort message. A
stop signal (SIGTERM, SIGUSR2) that finds the rank inside a wait dumps it too: the main thread, blocked in
MPI, cannot run the signal's Python handler, but the signal's byte on the wakeup fd reaches this thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from ..base.durable import write_text
from ..base.errors import HpctrainError
from ..base.stop import STOP_SIGNALS, close_wakeup_pipe, wakeup_pipe
from ..base.threads import join_logged
from ..trace.flight import RECORDER
from ..trace.lineup import line_up, read_dumps


class Watchdog:
    """Per-rank collective timeout; `abort` ends the job (MPI_Abort) when a collective waits too long."""

    def __init__(self, run_dir: Path | None, rank: int, world: int, *, timeout: float, abort: Callable[[int], None],
                 log: Callable[[str], None] | None = None, interval: float = 1.0):
        self.dir = Path(run_dir) / "logs" if run_dir is not None else None  # None: no heartbeat files yet
        self.rank, self.world, self.timeout = rank, world, timeout
        self.abort, self.log, self.interval = abort, log, interval
        self._phase: str | None = None
        self._budget = timeout
        self._edge: float | None = None  # the default budget while at an edge of the run (see `at_edge`)
        self._step = 0
        self._since = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None
        self._dumped = 0.0  # the wait (its start time) whose flight record this rank has dumped
        self._signal: tuple[int, float, float] | None = None  # a stop signal: (number, when, the wait it found)
        self._wakeup: tuple[int, int, int] | None = None  # (read end, write end, the previous wakeup fd)
        RECORDER.configure(rank, None, world)  # no dumps until the run directory exists (`attach`)

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self, run_dir: Path, log: Callable[[str], None] | None = None) -> None:
        """Write heartbeats to RUN/logs from now on (the run directory exists only once the inputs are
        checked), and log there too."""
        self.dir = Path(run_dir) / "logs"
        self.log = log or self.log
        path = self.dir / f"rank-{self.rank:04d}.flight.json"
        if self.rank == 0:  # an earlier run's dumps are kept, apart: the next dumps line up this run's only
            old = list(self.dir.glob("rank-*.flight.json"))
            if old:
                (self.dir / "previous").mkdir(exist_ok=True)
                for dump in old:
                    dump.replace(self.dir / "previous" / dump.name)
        RECORDER.configure(self.rank, path, self.world)

    def start(self) -> "Watchdog":
        if self.world > 1:
            try:
                self._beat()
            except OSError:
                pass
            self._wakeup = wakeup_pipe()
            self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def phase(self, name: str, step: int | None = None, budget: float | None = None) -> None:
        """Entering the wait `name` at `step` (None: the step of the last phase); it may take `budget`
        seconds (default: the collective timeout, or the edge budget at an edge of the run; 0: unwatched)."""
        self._step, self._since = self._step if step is None else step, time.time()
        default = self.timeout if self._edge is None else self._edge
        self._budget = default if budget is None else budget
        self._phase = name
        RECORDER.phase, RECORDER.step = name, self._step

    @contextlib.contextmanager
    def waiting(self, what: str, step: int | None = None, budget: float | None = None) -> Iterator[None]:
        """The wait `what` at `step` (as `phase`) for the block; after it, the wait it was nested in again (from
        now: a new wait), or none. A block left by an exception leaves its wait named: the hang report, the flight
        record and the heartbeat say where the rank was."""
        before = (self._phase, self._step, self._budget)
        self.phase(what, step, budget)
        yield
        if before[0] is None:
            self.idle()
        else:
            self.phase(*before)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """A block of this rank's own work, which waits for no other rank (a measurement, validation compute):
        unwatched however long load makes it, even inside a wait; after it, the wait it was in again (from now)."""
        before = (self._phase, self._step, self._budget)
        self.idle()
        yield
        if before[0] is not None:
            self.phase(*before)

    def at_edge(self, budget: float | None) -> None:
        """From now on, waits get `budget` by default instead of the collective timeout (None: back to it).

        At the start of a run (until its first step is done) and at its end, a wait on the other ranks also
        holds their own unequal work: building the model and the buckets, the first step's allocations, the
        final validation; on a busy node that is seconds, and a short --collective-timeout, right for the
        steady state, would abort a healthy job (stop.edge_budget: at least EDGE_FLOOR_S). A rank that is dead
        or stopped there is still found sooner by its silent heartbeat."""
        self._edge = budget

    @property
    def current(self) -> str | None:
        """The wait this rank is in (None: none)."""
        return self._phase

    def idle(self) -> None:
        self._phase = None
        RECORDER.phase = None

    def close(self) -> None:
        self._stop.set()
        if self._wakeup is not None:  # the thread sleeps in select() on the pipe: wake it (0 is no signal)
            try:
                os.write(self._wakeup[1], b"\0")
            except OSError:  # full: it is awake already
                pass
        join_logged(self._thread, 5 * self.interval + 5, "heartbeat")
        self._thread = None
        if self._wakeup is not None:
            pipe, self._wakeup = self._wakeup, None
            if threading.current_thread() is threading.main_thread():
                close_wakeup_pipe(pipe)
        if self.dir is not None:
            try:
                (self.dir / f"rank-{self.rank:04d}.heartbeat").unlink()
            except FileNotFoundError:
                pass

    def _beat(self) -> None:
        if self.dir is None:
            return
        write_text(self.dir / f"rank-{self.rank:04d}.heartbeat",
                   json.dumps({"rank": self.rank, "step": self._step, "phase": self._phase, "since": self._since,
                               "time": time.time(), "pid": os.getpid(), "frozen_s": RECORDER.frozen_s,
                               "frozen_until": RECORDER.frozen_until}))

    def _others(self, now: float) -> list[str]:
        """Who this rank is waiting for: ranks behind it, or silent for longer than a few beats."""
        waiting: list[str] = []
        if self.dir is None:
            return waiting
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                beat = json.loads((self.dir / f"rank-{r:04d}.heartbeat").read_text())
            except (OSError, ValueError):
                waiting.append(f"rank {r} (no heartbeat)")
                continue
            silent = now - beat["time"]
            if silent > 3 * self.interval:
                waiting.append(f"rank {r} (silent for {silent:.0f} s: dead or stuck, last at step {beat['step']})")
            elif beat["step"] < self._step or beat["phase"] != self._phase:
                waiting.append(f"rank {r} (at step {beat['step']}, {beat['phase'] or 'computing'})")
        return waiting

    def _silent(self, now: float, longer_than: float) -> list[str]:
        """Ranks whose heartbeat stopped more than `longer_than` seconds ago: stopped, dead, or stuck with the
        interpreter held (a rank that is only slow, e.g. writing to a slow filesystem, still beats)."""
        silent = []
        for r in range(self.world):
            try:
                beat = json.loads((self.dir / f"rank-{r:04d}.heartbeat").read_text()) if r != self.rank else None
            except (OSError, ValueError):
                continue  # no heartbeat yet: cannot judge
            if beat is not None and now - beat["time"] > longer_than:
                silent.append(f"rank {r} (silent for {now - beat['time']:.0f} s: dead or stuck, last at step "
                              f"{beat['step']})")
        return silent

    def _sleep(self) -> bool:
        """One interval (False: stop); a stop signal that arrives meanwhile is noted with the wait it finds."""
        if self._wakeup is None:
            return not self._stop.wait(self.interval)
        ready, _, _ = select.select([self._wakeup[0]], [], [], self.interval)
        if ready:
            try:
                got = os.read(self._wakeup[0], 64)
            except OSError:
                got = b""
            stops = [n for n in got if n in STOP_SIGNALS]
            if stops and self._phase is not None:
                self._signal = (stops[-1], time.time(), self._since)
        return not self._stop.is_set()

    def _dump(self, reason: str) -> None:
        """This rank's flight record, once per wait."""
        if self._dumped != self._since:
            self._dumped = self._since
            RECORDER.dump(reason)

    def _run(self) -> None:
        next_look, last = 0.0, time.monotonic()
        while self._sleep():
            gap, last = time.monotonic() - last - self.interval, time.monotonic()
            if gap > max(3 * self.interval, 2.0):  # this process did not run: stopped (SIGSTOP) or starved of CPU
                RECORDER.frozen_s, RECORDER.frozen_until = gap, time.time()
            try:
                self._beat()
            except OSError:
                pass
            phase, budget = self._phase, self._budget
            now = time.time()
            waited = now - self._since
            if phase is None:
                continue
            if self._signal is not None and self._signal[2] == self._since:  # a stop that finds this rank stuck
                signum, at, _ = self._signal
                if signum == signal.SIGTERM or now - at >= 1.0:  # SIGTERM: a kill may follow at once
                    self._dump(f"{signal.Signals(signum).name} while in {phase} at step {self._step} "
                               f"(waiting {waited:.0f} s)")
            if budget > 0 and waited > budget / 2:
                self._dump(f"{phase} at step {self._step} waiting {waited:.0f} s (half its budget of {budget:g} s)")
            if budget > 0 and waited > budget:
                others = self._others(now) or ["no rank found behind: a network or MPI problem"]
                option = "--collective-timeout" if budget == self.timeout else "its budget,"
                self._fire(f"rank {self.rank}: {phase} at step {self._step} has waited {waited:.0f} s (over "
                           f"{option} {budget:g} s) for {', '.join(others)}; aborting the job")
                return
            # A long wait within a longer budget (a checkpoint write) is fine while every rank still beats; one
            # that went silent for longer than the collective timeout will never come. Looked at every 5 s only,
            # and only in such waits: W ranks reading W heartbeat files is not free on a parallel filesystem.
            if (self.dir is not None and 0 < self.timeout < waited and (budget <= 0 or budget > self.timeout)
                    and now >= next_look):
                next_look = now + 5 * self.interval
                silent = self._silent(now, max(self.timeout, 3 * self.interval))  # a beat can be a little late
                if silent:
                    self._fire(f"rank {self.rank}: {phase} at step {self._step} has waited {waited:.0f} s for "
                               f"{', '.join(silent)} (over --collective-timeout {self.timeout:g} s); aborting the job")
                    return

    def _fire(self, message: str) -> None:
        self._dumped = 0.0
        self._dump(f"watchdog: {message}")
        if self.rank == 0 and self.dir is not None:  # rank 0 lines up the dumps it finds (the others dumped at half)
            try:
                found = line_up(self.world, *read_dumps(self.dir, self.world)[:2])
                message += f"; flight records: {found['text']}"
            except Exception as exc:  # noqa: BLE001 - the abort must happen
                message += f"; the flight records could not be lined up ({exc!r}): run hpctrain report"
        self.fired = message
        print(f"error: {message}", file=sys.stderr, flush=True)
        if self.log is not None:
            self.log(message)
        self.abort(1)


def waiting(watchdog: Watchdog | None, what: str, step: int | None = None,
            budget: float | None = None) -> ContextManager[None]:
    """`watchdog.waiting(...)`, or nothing where no watchdog watches (a caller of the library's own)."""
    return contextlib.nullcontext() if watchdog is None else watchdog.waiting(what, step, budget)


def working(watchdog: Watchdog | None) -> ContextManager[None]:
    """`watchdog.working()`, or nothing where no watchdog watches."""
    return contextlib.nullcontext() if watchdog is None else watchdog.working()


def end_job(comm: Any, error: HpctrainError) -> None:
    """This rank failed alone (a corrupt chunk in its shard, a failed allreduce, a full disk): the others
    are already on their way into the next collective and would wait for it forever. Say why here, on
    this rank's stderr and log, dump its flight record, then end every rank of the job (MPI_Abort) with the
    error's exit code."""
    text = str(error).replace("\n", " ")
    if not text.startswith(f"rank {comm.rank}"):
        text = f"rank {comm.rank}: {text}"
    logging.getLogger(f"hpctrain.rank{comm.rank}").error("%s; ending the job", text)
    RECORDER.dump(f"error: {text}")
    print(f"error: {text}; ending the job (the other ranks would wait for this one)", file=sys.stderr, flush=True)
    comm.abort(error.exit_code)
