"""The flight recorder: the last `CAPACITY` collectives and point-to-point transfers of this process, always on.

Every collective of the comm layer calls `RECORDER.begin(...)` as it enters and `RECORDER.end(seq)` as it
leaves: each bucket's gradient sum (GradSync's allreduce, ZeroSync's reduce-scatter, their rank-ordered and
compressed forms), ZeRO's parameter allgather, the small collectives of `Comm` (reductions, agreements,
broadcasts, gathers, barriers) and the activation sums of tensor parallelism (`p2p.allreduce_`). Each
point-to-point transfer of a pipeline calls `RECORDER.post(...)` as its MPI_Isend / MPI_Irecv is posted and
`end(seq)` once it is seen complete. A record is one row of a ring built at import and reused in place: no dict
and no object per record, no lock. `itertools.count` hands out sequence numbers atomically under the GIL, and
a row is written only by the thread that runs its collective. The cost is in docs/performance.md (flight
recorder on against off).

Three numbers place a record. `seq` counts this process's records in the order they were entered (what the
timeline copies per step). `group` is the communicator, registered once by `Comm` (`group(name, ranks)`: a
name such as "world" or "data-parallel group" and its members as ranks of the run); `gseq` counts the
collectives of that communicator, which every member enters in the same order (MPI requires it), so the
records of a group's members line up by it (`lineup`). A transfer is numbered on its channel instead (the
communicator, the peer and the operation: "send activations" to rank 2), in the order MPI matches the
messages of a channel, so the n-th send of a channel meets the peer's n-th receive. Each record also carries
the trainer's phase and step (the watchdog sets them as it enters each wait), the pipeline's micro-batch
(`micro`, set by the pipeline before each of its operations), the peer of a transfer (a rank of the run) and
the time its bucket was handed to the communication thread (`handoff`).

`dump(reason)` writes the ring to RUN/logs/rank-NNNN.flight.json (the watchdog, a forced stop and a failing
rank call it), with the groups, the channels, the phase the rank was in and the transfers it was blocked on;
a collective or a transfer still running shows there with no end time.
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
FIELDS = ("seq", "op", "bucket", "bytes", "dtype", "phase", "step", "enqueue", "start", "end", "thread", "group", "gseq",
          "peer", "micro")  # a row of the ring holds these, then a byte counter's value at entry (see `begin`)
_SEQ, _BYTES, _DTYPE, _END = (FIELDS.index(name) for name in ("seq", "bytes", "dtype", "end"))
_COUNTER = len(FIELDS)
WORLD = 0  # the group of a record whose caller names none: every rank of the run


class FlightRecorder:
    """A ring of the last `capacity` collectives and transfers; times are `time.perf_counter()` seconds
    (CLOCK_MONOTONIC, one clock for every process of a node)."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity {capacity} must be a power of two")
        self.capacity = capacity
        self._mask = capacity - 1
        # the fields, and a byte counter's value at entry (see `begin`)
        self._ring: list[list[Any]] = [[-1, "", -1, 0, "", None, 0, 0.0, 0.0, 0.0, 0, 0, -1, -1, -1, None]
                                       for _ in range(capacity)]
        self._seq = itertools.count()
        self._handoff: dict[int, float] = {}
        self.entered = 0  # sequence number of the next record (the count entered so far)
        self.groups: list[tuple[str, tuple[int, ...] | None]] = [("world", None)]  # id -> (name, ranks of the run)
        # per group, its next sequence number (= the collectives it entered): a plain count, for the collectives of
        # one communicator never run on two threads at once (MPI requires them in one order on every rank)
        self.gentered: list[int] = [0]
        self.channels: dict[tuple[int, int, str], list[int]] = {}  # (group, peer, op) -> [transfers posted]
        self.blocked: tuple[int, ...] = ()  # the transfers (seq) the training thread is waiting for now
        self.micro = -1  # the pipeline's micro-batch being computed (-1: none)
        self.phase: str | None = None  # the trainer's wait, and its step (the watchdog sets both)
        self.step = 0
        self.rank, self.world = 0, 1
        self.path: Path | None = None  # where `dump` writes; None: nowhere yet
        self.hang: tuple[int, int] | None = None  # test hook: (step, bucket) this rank never enters
        self.frozen_s = self.frozen_until = 0.0  # the last time this process did not run (stopped, starved): how long,
        # and until when (time.time()), as its watchdog saw it
        self.dumpers: list[Callable[[str], None]] = []  # what else writes its state beside a dump (the timeline)

    def group(self, name: str, ranks: tuple[int, ...]) -> int:
        """Register a communicator (its `name` and its members as ranks of the run, in its rank order): the id
        its records carry. Every communicator gets its own id and numbering (`Comm` registers each once)."""
        self.groups.append((name, tuple(ranks)))
        self.gentered.append(0)
        return len(self.groups) - 1

    # -- the hot path ---------------------------------------------------------------------------------------
    def handoff(self, bucket: int) -> None:
        """Bucket `bucket` was handed to the communication thread now (its collective starts later)."""
        self._handoff[bucket] = time.perf_counter()

    def begin(self, op: str, bucket: int = -1, dtype: Any = "", nbytes: int = 0, counter: int | None = None,
              group: int = WORLD, micro: int = -1) -> int:
        """A collective `op` (of gradient bucket `bucket`, -1: none) of communicator `group` enters now; returns
        its sequence number for `end`. Its bytes: `nbytes`, or what a byte counter (now at `counter`) has grown
        by at `end`. `micro`: the pipeline's micro-batch it belongs to (-1: none)."""
        now = time.perf_counter()
        if self.hang is not None and self.hang == (self.step, bucket):
            self._never_enter(op, bucket)
        gseq = self.gentered[group]
        self.gentered[group] = gseq + 1
        seq = next(self._seq)
        row = self._ring[seq & self._mask]
        row[1:] = (op, bucket, nbytes, dtype, self.phase, self.step, self._handoff.pop(bucket, now) if bucket >= 0
                   else now, now, 0.0, threading.get_ident(), group, gseq, -1, micro, counter)
        row[_SEQ] = seq  # last: a row whose seq is not yet its own is being written
        self.entered = seq + 1
        return seq

    def post(self, op: str, peer: int, dtype: Any, nbytes: int, group: int, micro: int = -1) -> int:
        """A point-to-point transfer `op` ("send activations", "recv activations", ...) with rank `peer` of the
        run, over communicator `group`, is posted now; returns its sequence number for `end` (when it is seen
        complete). Numbered on its channel (group, peer, op): the n-th send of a channel meets the n-th receive."""
        now = time.perf_counter()
        key = (group, peer, op)
        posted = self.channels.get(key)
        if posted is None:
            posted = self.channels[key] = [0]
        gseq = posted[0]
        posted[0] += 1  # transfers are posted by one thread: the training loop's
        seq = next(self._seq)
        row = self._ring[seq & self._mask]
        row[1:] = (op, -1, nbytes, dtype, self.phase, self.step, now, now, 0.0, threading.get_ident(), group, gseq, peer,
                   micro, None)
        row[_SEQ] = seq
        self.entered = seq + 1
        return seq

    def end(self, seq: int, counter: int | None = None) -> None:
        """Collective (or transfer) `seq` left now; `counter`: the byte counter's value now (see `begin`)."""
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

    def context(self) -> dict[str, Any]:
        """What places the records: the groups (id -> name, ranks, collectives entered), the channels of
        transfers (group, peer, op, transfers posted), and where this rank's training thread is now."""
        return {"groups": [{"name": name, "ranks": None if ranks is None else list(ranks), "entered": entered}
                           for (name, ranks), entered in zip(list(self.groups), list(self.gentered))],
                "channels": [[*key, posted[0]] for key, posted in list(self.channels.items())],
                "phase": self.phase, "step": self.step, "blocked": list(self.blocked)}

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
               "fields": FIELDS, "records": self.rows(), "threads": thread_names(), **self.context()}
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
