"""The flight recorder: the last `CAPACITY` collectives of this process, always on.

Every collective of the comm layer calls `RECORDER.begin(...)` as it enters and `RECORDER.end(seq)` as it
leaves: each bucket's gradient sum (GradSync's allreduce, ZeroSync's reduce-scatter, their rank-ordered and
compressed forms), ZeRO's parameter allgather, and the small collectives of `Comm` (reductions, agreements,
broadcasts, gathers, barriers). A record is one row of a ring built at import and reused in place: no dict and
no object per record, no lock. `itertools.count` hands out sequence numbers atomically under the GIL, and a row
is written only by the thread that runs its collective. The cost is in docs/performance.md (flight recorder
on against off).

Sequence numbers count this process's collectives in the order they were entered; every rank enters the
collectives of one communicator in the same order (MPI requires it), so the records of all ranks line up
by sequence number (`lineup`). Each record also carries the trainer's phase and step (the watchdog sets
them as it enters each wait) and the time its bucket was handed to the communication thread (`handoff`).

`dump(reason)` writes the ring to RUN/logs/rank-NNNN.flight.json (the watchdog, a forced stop and a failing
rank call it); a collective still running shows there with no end time.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..base.durable import write_text

CAPACITY = 1024  # records kept per process (a power of two); a step of the reference MLP makes about 6
FIELDS = ("seq", "op", "bucket", "bytes", "dtype", "phase", "step", "enqueue", "start", "end", "thread")
_SEQ, _OP, _BUCKET, _BYTES, _DTYPE, _PHASE, _STEP, _ENQUEUE, _START, _END, _THREAD, _COUNTER = range(len(FIELDS) + 1)


class FlightRecorder:
    """A ring of the last `capacity` collectives; times are `time.perf_counter()` seconds (CLOCK_MONOTONIC,
    one clock for every process of a node)."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity {capacity} must be a power of two")
        self.capacity = capacity
        self._mask = capacity - 1
        # the fields, and a byte counter's value at entry (see `begin`)
        self._ring: list[list[Any]] = [[-1, "", -1, 0, "", None, 0, 0.0, 0.0, 0.0, 0, None] for _ in range(capacity)]
        self._seq = itertools.count()
        self._handoff: dict[int, float] = {}
        self.entered = 0  # sequence number of the next collective (the count entered so far)
        self.phase: str | None = None  # the trainer's wait, and its step (the watchdog sets both)
        self.step = 0
        self.rank, self.world = 0, 1
        self.path: Path | None = None  # where `dump` writes; None: nowhere yet
        self.hang: tuple[int, int] | None = None  # test hook: (step, bucket) this rank never enters
        self.frozen_s = self.frozen_until = 0.0  # the last time this process did not run (stopped, starved): how long,
        # and until when (time.time()), as its watchdog saw it
        self.dumpers: list[Callable[[str], None]] = []  # what else writes its state beside a dump (the timeline)

    # -- the hot path ---------------------------------------------------------------------------------------
    def handoff(self, bucket: int) -> None:
        """Bucket `bucket` was handed to the communication thread now (its collective starts later)."""
        self._handoff[bucket] = time.perf_counter()

    def begin(self, op: str, bucket: int = -1, dtype: Any = "", nbytes: int = 0, counter: int | None = None) -> int:
        """A collective `op` (of gradient bucket `bucket`, -1: none) enters now; returns its sequence number for
        `end`. Its bytes: `nbytes`, or what a byte counter (now at `counter`) has grown by at `end`."""
        now = time.perf_counter()
        if self.hang is not None and self.hang == (self.step, bucket):
            self._never_enter(op, bucket)
        seq = next(self._seq)
        row = self._ring[seq & self._mask]
        row[_OP], row[_BUCKET], row[_BYTES], row[_DTYPE], row[_COUNTER] = op, bucket, nbytes, dtype, counter
        row[_PHASE], row[_STEP], row[_START], row[_END] = self.phase, self.step, now, 0.0
        row[_ENQUEUE] = self._handoff.pop(bucket, now) if bucket >= 0 else now
        row[_THREAD] = threading.get_ident()
        row[_SEQ] = seq  # last: a row whose seq is not yet its own is being written
        self.entered = seq + 1
        return seq

    def end(self, seq: int, counter: int | None = None) -> None:
        """Collective `seq` left now; `counter`: the byte counter's value now (see `begin`)."""
        row = self._ring[seq & self._mask]
        if row[_SEQ] != seq:  # written over: more collectives in flight than the ring holds
            return
        row[_END] = time.perf_counter()
        if counter is not None and row[_COUNTER] is not None:
            row[_BYTES] = counter - row[_COUNTER]

    # -- reading it -----------------------------------------------------------------------------------------
    def rows(self, first: int = 0, stop: int | None = None) -> list[list[Any]]:
        """Copies of the records with sequence numbers in [first, stop) still in the ring, oldest first, as
        plain JSON values (the dtype as its name)."""
        stop = self.entered if stop is None else stop
        out = []
        for seq in range(max(first, stop - self.capacity), stop):
            row = self._ring[seq & self._mask][:_COUNTER]
            if row[_SEQ] == seq:
                row[_DTYPE] = str(row[_DTYPE]).removeprefix("torch.")
                out.append(row)
        return out

    def configure(self, rank: int, path: Path | None, world: int = 1) -> None:
        """This process is rank `rank` of `world`; `dump` writes to `path`."""
        self.rank, self.path, self.world = rank, path, world
        self.frozen_s = self.frozen_until = 0.0

    def dump(self, reason: str) -> Path | None:
        """Write the ring (and what `dumpers` hold) beside the run; never raises. The path, or None."""
        for extra in self.dumpers:
            try:
                extra(reason)
            except Exception:  # noqa: BLE001 - a dump is best effort, on the way to an abort
                pass
        if self.path is None:
            return None
        doc = {"rank": self.rank, "world": self.world, "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
               "time": time.time(), "clock": time.perf_counter(), "capacity": self.capacity, "entered": self.entered,
               "frozen_s": self.frozen_s, "frozen_until": self.frozen_until,
               "fields": FIELDS, "records": self.rows(), "threads": thread_names()}
        try:
            write_text(self.path, json.dumps(doc))
        except OSError as exc:
            print(f"warning: rank {self.rank}: cannot write the flight record {self.path}: {exc}", file=sys.stderr)
            return None
        return self.path

    def _never_enter(self, op: str, bucket: int) -> None:
        """The test hook HPCTRAIN_TEST_HANG: this rank stops here for good, before collective `op` of `bucket`,
        as a rank stuck in its own code would; the other ranks wait for it in that collective."""
        print(f"test hook: rank {self.rank} never enters {op} of bucket {bucket} at step {self.step}", file=sys.stderr,
              flush=True)
        threading.Event().wait()


def thread_names() -> dict[str, str]:
    """{thread ident: name} of the threads alive now (JSON keys are strings)."""
    return {str(t.ident): t.name for t in threading.enumerate() if t.ident is not None}


RECORDER = FlightRecorder()
