"""Named collectives negotiated across ranks: the engine behind `hpctrain.horovod`.

Ranks submit operations (allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join) by name, in
any order and from any thread; a background thread per process set matches them **by name**, as Horovod's
coordinator does, and runs each one once every member has submitted it. What it gives that a thin wrapper over
mpi4py does not:

- asynchronous handles: `submit` returns at once, the thread does the work (`Entry.done`);
- ranks may submit in different orders; ready allreduces of one kind are fused into one buffer;
- a mismatch (shape, dtype, root, op, device; an allgather or broadcast while a rank has joined) fails the
  operation on every rank with a message naming the tensor and the ranks, instead of a hang or garbage; a
  name submitted again while it is in flight raises `ValueError` at once on the rank that did it;
- `join`: a joined rank contributes zeros to allreduces (the divisor stays the set's size) until all have
  joined; everyone then learns the last rank to join;
- a name some ranks never submit is reported with the ranks missing (the stall inspector) and, after the
  shutdown time, the job is ended.

How: in each round every member announces what it submitted since the last round (one `Iallgather` of sizes
and one `Iallgatherv` of pickled requests, polled with short sleeps so a waiting rank does not spin a core);
every member then holds the same table and derives the same ready list in the same order, so the data
collectives that follow (collops.py) are issued identically everywhere. A rank with nothing in flight takes
part in no round; the others wait for it in theirs.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..base.errors import CommError
from .collops import run_ready
from .world import load_mpi

log = logging.getLogger("hpctrain")

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join")
_CHECKED = {  # what must agree across ranks, per kind (besides kind, dtype and device)
    "allreduce": ("shape", "op", "prescale", "postscale", "divisor"),
    "reducescatter": ("shape", "op", "prescale", "postscale", "divisor"),
    "broadcast": ("shape", "root"),
    "allgather": ("tail",),
    "alltoall": ("tail",),
    "barrier": (),
    "join": (),
}


class CollectiveError(CommError, RuntimeError):
    """A negotiated collective failed on every rank that took part (a mismatch, an unsupported combination)."""


@dataclass(frozen=True, slots=True)
class Request:
    """What one rank announces of one operation: everything the others must agree with."""

    name: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = "cpu"
    op: str = "sum"  # sum, min, max, product (average is a sum with a divisor)
    root: int = -1  # broadcast: the root's global rank
    prescale: float = 1.0
    postscale: float = 1.0
    divisor: int = 1
    splits: tuple[int, ...] = ()  # alltoall: rows sent to each member, in member order

    @property
    def tail(self) -> tuple[int, int | None]:
        return (len(self.shape), self.shape[1:]) if self.shape else (0, None)


@dataclass(slots=True)
class Entry:
    """One submitted operation on this rank: its request, its tensors, and its completion."""

    request: Request
    tensor: Any = None  # the input (None for barrier and join)
    output: Any = None  # where the result goes (the input itself for in-place operations)
    result: Any = None  # set by the engine: the output, or (output, received splits) for alltoall
    error: BaseException | None = None
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class Negotiator:
    """The background thread of one process set: rounds of announcements, matching, execution."""

    def __init__(self, mpi_comm: Any, ranks: list[int], *, abort: Callable[[int], None] | None = None):
        self.comm = mpi_comm  # a communicator of its own: no other code issues collectives on it
        self.ranks = ranks  # global rank of each member
        self.member = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.fusion_bytes = int(_env_seconds("HOROVOD_FUSION_THRESHOLD", 64 * 2**20))
        self.stall_check_s = _env_seconds("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0)
        # Horovod never ends a stalled job by default; hpctrain does after its --collective-timeout default (0: never)
        self.stall_shutdown_s = _env_seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 300.0)
        self._abort = abort
        self._cv = threading.Condition()
        self._new: list[Entry] = []  # submitted, not announced yet
        self._inflight: dict[str, Entry] = {}  # submitted, not done
        self._table: dict[str, dict[int, Request]] = {}  # name -> member -> request, as every member holds it
        self._joined: set[int] = set()
        self._join_order: list[int] = []
        self._stopping = False
        self._last_report = 0.0
        self._thread = threading.Thread(target=self._run, name=f"hpctrain-negotiate-{ranks}", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------------
    def submit(self, entry: Entry) -> Entry:
        name = entry.request.name
        with self._cv:
            if self._stopping:
                raise CommError("hpctrain.horovod has been shut down; call hvd.init() again first")
            if name in self._inflight:
                raise ValueError(f"a {self._inflight[name].request.kind} named '{name}' is still in flight on rank "
                                 f"{self.ranks[self.member]}: give concurrent operations distinct names")
            self._inflight[name] = entry
            self._new.append(entry)
            self._cv.notify()
        return entry

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once nothing is in flight (or after `timeout`); True if it ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        idle_rounds = 0
        while True:
            with self._cv:
                while not (self._new or self._inflight or self._stopping):
                    self._cv.wait()
                if self._stopping and not self._inflight:
                    return
                if not self._new and idle_rounds:  # nothing new here: let the others catch up, wake on a submit
                    self._cv.wait(min(0.002, 0.0001 * idle_rounds))
                batch, self._new = self._new, []
            try:
                progressed = self._round(batch)
            except Exception as exc:  # noqa: BLE001 - a broken round fails everything in flight, loudly
                log.error("hpctrain.horovod: negotiation failed on rank %d: %r", self.ranks[self.member], exc)
                self._fail_all(CommError(f"negotiation failed on rank {self.ranks[self.member]}: {exc!r}"))
                return
            idle_rounds = 0 if progressed or batch else min(idle_rounds + 1, 20)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            entries, self._inflight, self._new = list(self._inflight.values()), {}, []
            self._stopping = True
        for entry in entries:
            entry.finish(error=error)

    def _round(self, batch: list[Entry]) -> bool:
        """One announcement round; runs what became ready. True when anything completed."""
        mine = ([e.request for e in batch if e.request.kind != "join"], any(e.request.kind == "join" for e in batch))
        blobs = self._exchange(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
        grew = []
        for member, blob in enumerate(blobs):
            requests, joins = pickle.loads(blob)
            if joins and member not in self._joined:
                self._joined.add(member)
                grew.append(member)
            for request in requests:
                self._table.setdefault(request.name, {})[member] = request
        if grew:
            self._join_order.append(max(grew))
        ready = [name for name, got in self._table.items()
                 if all(m in got or m in self._joined for m in range(self.size))]
        progressed = False
        if ready:
            self._execute([(name, self._table.pop(name)) for name in ready])
            progressed = True
        if len(self._joined) == self.size:
            last = self.ranks[self._join_order[-1]]
            self._joined.clear()
            self._join_order.clear()
            self._complete(self._pop_join(), last)
            progressed = True
        return progressed

    def _pop_join(self) -> Entry | None:
        with self._cv:
            names = [n for n, e in self._inflight.items() if e.request.kind == "join"]
            return self._inflight.pop(names[0]) if names else None

    def _complete(self, entry: Entry | None, result: Any = None, error: BaseException | None = None) -> None:
        if entry is not None:
            entry.finish(result, error)

    def _execute(self, ready: list[tuple[str, dict[int, Request]]]) -> None:
        """Check each ready operation, then run the good ones in the same order on every member."""
        runnable = []
        for name, got in ready:
            with self._cv:
                entry = self._inflight.pop(name, None)
            problem = self._mismatch(name, got)
            if problem is not None:
                self._complete(entry, error=CollectiveError(problem))
                continue
            runnable.append((got[min(got)], got, entry))
        if runnable:
            try:
                run_ready(self.comm, self.member, self.ranks, runnable, self.fusion_bytes, self._wait)
            except BaseException as exc:  # the round is broken: these entries fail, and _run fails the rest
                for _, _, entry in runnable:
                    if entry is not None and not entry.done.is_set():
                        entry.finish(error=CommError(f"running '{entry.request.name}' failed: {exc!r}"))
                raise

    def _mismatch(self, name: str, got: dict[int, Request]) -> str | None:
        """Why these announcements cannot run together, naming the tensor and the ranks; None if they can."""
        first = got[min(got)]
        for attribute in ("kind", "dtype", "device") + _CHECKED.get(first.kind, ()):
            values: dict[Any, list[int]] = {}
            for member, request in sorted(got.items()):
                values.setdefault(getattr(request, attribute), []).append(self.ranks[member])
            if len(values) > 1:
                said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                                 for v, r in values.items())
                return (f"{first.kind} '{name}': the ranks disagree on its {attribute} ({said}); every rank must "
                        f"submit the same {attribute} under one name")
        if self._joined and first.kind not in ("allreduce", "join"):
            joined = ", ".join(str(self.ranks[m]) for m in sorted(self._joined))
            return (f"{first.kind} '{name}' cannot run while rank(s) {joined} have joined (hvd.join): only "
                    "allreduce works with joined ranks; finish the other collectives before join()")
        if first.kind == "broadcast" and first.root not in self.ranks:
            return f"broadcast '{name}': root rank {first.root} is not in the process set {self.ranks}"
        return None

    # -- MPI, polled -------------------------------------------------------------------------------
    def _exchange(self, payload: bytes) -> list[bytes]:
        MPI = load_mpi()
        sizes = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([len(payload)], dtype=np.int64), sizes))
        displs = np.zeros(self.size, dtype=np.int64)
        displs[1:] = np.cumsum(sizes)[:-1]
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        send = np.frombuffer(payload, dtype=np.uint8)
        self._wait(self.comm.Iallgatherv(send, [recv, sizes.tolist(), displs.tolist(), MPI.BYTE]))
        return [recv[d:d + s].tobytes() for d, s in zip(displs.tolist(), sizes.tolist())]

    def _wait(self, request: Any) -> None:
        """Poll one MPI request to completion, yielding the CPU (a blocking MPI wait would spin a core the
        rank's compute needs): sleeps grow with the wait, to at most 0.5 ms. Reports a stall; ends a stuck job."""
        start = time.perf_counter()
        polls = 0
        while not request.Test():
            polls += 1
            waited = time.perf_counter() - start
            time.sleep(0 if waited < 0.0002 else min(0.0005, waited / 10))
            if polls % 256 == 0:
                self._check_stall()

    def _check_stall(self) -> None:
        with self._cv:
            # a joined rank waits for the others' remaining work, however long: not a stall
            oldest = min((e.submitted for e in self._inflight.values() if e.request.kind != "join"), default=None)
        if oldest is None:
            return
        waited = time.monotonic() - oldest
        now = time.monotonic()
        if self.stall_check_s > 0 and waited > self.stall_check_s and now - self._last_report > self.stall_check_s:
            self._last_report = now
            log.warning("hpctrain.horovod stall (%.0f s): %s", waited, self.stall_report())
        if self.stall_shutdown_s > 0 and waited > self.stall_shutdown_s:
            log.error("hpctrain.horovod: ending the job after %.0f s of stall "
                      "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS): %s", waited, self.stall_report())
            if self._abort is not None:
                self._abort(1)

    def stall_report(self) -> str:
        """Which names are waiting, and for which ranks (Horovod's stall inspector)."""
        with self._cv:
            mine = {n: e.request.kind for n, e in self._inflight.items()}
        lines = []
        for name, kind in mine.items():
            got = self._table.get(name, {self.member: None})
            missing = [self.ranks[m] for m in range(self.size) if m not in got and m not in self._joined]
            have = [self.ranks[m] for m in sorted(got)] or [self.ranks[self.member]]
            lines.append(f"{kind} '{name}' submitted by rank(s) {have}, missing on rank(s) "
                         f"{missing or 'unknown (they have not announced since)'}")
        return "; ".join(lines) or "nothing in flight"
