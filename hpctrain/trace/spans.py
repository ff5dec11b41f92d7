"""The timeline of one rank: spans of every phase of the steps in a bounded window (`--trace WINDOW`).

`TRACER` is off until `start(window)`. The trainer marks each step's beginning (`begin_step`); steps the
window selects are recorded, the others cost one attribute test per span. A recorded step holds its spans
(data wait, forward, backward, wait, optimizer, validation, checkpoint stall and background write, from
whichever thread ran them; a pipeline's forward and backward of each micro-batch and its waits for a
neighbour stage) and, when the next step begins, a copy of the flight recorder's collectives and transfers
entered during it (recorded once, by the comm layer's one hook: `flight`; a step that enters more than half
the ring, as a tensor-parallel one can, is copied as it goes).

Bounded by design, never growing with the run (`base.window`): a range of at most MAX_STEPS steps (`A:B`),
the last N steps of the run (`last:N`, a ring) or one step in N (`every:N`, a ring of the last EVERY_KEEP
sampled steps); a step keeps at most `MAX_SPANS` spans. `snapshot()` is this rank's file
(RUN/trace/rank-NNNN.json); `chrome` merges the files of all ranks.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..base.durable import write_text
from ..base.window import Window
from .flight import FIELDS, RECORDER, thread_names

MAX_SPANS = 4096  # most spans one step keeps (a user's loop may record its own)
FORMAT = 2  # 2: records place themselves (group, gseq, peer, micro) and the file lists the groups


class Tracer:
    """One rank's spans, per recorded step. Times are `time.perf_counter()` seconds."""

    def __init__(self) -> None:
        self.window: Window | None = None
        self.active = False  # recording the current step
        self.steps: collections.deque[dict[str, Any]] = collections.deque()
        self.current: dict[str, Any] | None = None
        self.startup: list[list[Any]] = []
        self.names: dict[int, str] = {}
        self.clock: dict[str, Any] = {}  # this rank's clock against rank 0's (set by whoever measured it)
        self.dropped = 0
        self.rank = 0
        self.main = threading.get_ident()

    def start(self, window: Window | None, rank: int = 0) -> None:
        """Record the steps `window` selects from now on (None: record nothing, forget what was recorded)."""
        self.window, self.rank, self.main = window, rank, threading.get_ident()
        self.steps = collections.deque(maxlen=window.keep if window else 1)
        self.current, self.startup, self.clock, self.dropped = None, [], {}, 0
        # the start-up (staging, before step 1) with the steps that follow it: a ring, or a range from step 1
        self.active = window is not None and (window.kind != "range" or window.a == 1)

    def stop(self) -> None:
        self._close_step()
        self.window, self.active = None, False

    def begin_step(self, step: int) -> None:
        """Step `step` (1-based, as in metrics.jsonl) begins now: recorded when the window selects it."""
        if self.window is None:
            return
        self._close_step()
        if self.window.selects(step):
            self.current = {"step": step, "spans": [], "first": RECORDER.entered, "collectives": [], "lost": 0}
            self.steps.append(self.current)
            self.active = True
        else:
            self.active = False

    def span(self, name: str, start: float, end: float, **args: Any) -> None:
        """A span of phase `name` on the calling thread, if this step is recorded."""
        if not self.active:
            return
        ident = threading.get_ident()
        if ident not in self.names:
            self.names[ident] = threading.current_thread().name
        step = self.current
        spans = step["spans"] if step is not None else self.startup
        if len(spans) >= MAX_SPANS:
            self.dropped += 1
            return
        spans.append([name, ident, start, end, args or None])
        if step is not None and ident == self.main and RECORDER.entered - step["first"] > RECORDER.capacity // 2:
            self._copy(step)  # before the ring writes over them

    def timed(self, name: str, **args: Any) -> "_Timed":
        """`with TRACER.timed("validation"):` records the block as a span."""
        return _Timed(self, name, args)

    def _close_step(self) -> None:
        """The current step ends: keep a copy of the collectives entered during it."""
        step = self.current
        if step is not None and "first" in step:
            self._copy(step)
            del step["first"]
        self.current = None

    def _copy(self, step: dict[str, Any]) -> None:
        """Copy the records entered since `step["first"]` into the step (the training thread only)."""
        copied = self._collectives(step)
        step["collectives"] += copied["collectives"]
        step["lost"] += copied["lost"]
        step["first"] = RECORDER.entered

    def _collectives(self, step: dict[str, Any]) -> dict[str, Any]:
        """The records entered since `step["first"]`, and how many of them the ring no longer holds."""
        entered = RECORDER.entered
        rows = RECORDER.rows(step["first"], entered)
        for row in rows:
            ident = row[FIELDS.index("thread")]
            if ident not in self.names:
                self.names.update({int(k): v for k, v in thread_names().items()})
                self.names.setdefault(ident, f"thread {ident}")
        return {"collectives": rows, "lost": entered - step["first"] - len(rows)}

    def snapshot(self, close: bool = True) -> dict[str, Any]:
        """This rank's timeline as one JSON-ready dict; `close`: end the current step first (the training
        thread; a dump from another thread leaves it open and copies what it holds so far)."""
        if close:
            self._close_step()
        steps = []
        for s in list(self.steps):  # list(): one step of C, not disturbed by the training thread
            s = dict(s)
            if "first" in s:  # still open (a dump from another thread): what it holds so far, and the rest
                more = self._collectives(s)
                s.update(collectives=s["collectives"] + more["collectives"], lost=s["lost"] + more["lost"])
                del s["first"]
            steps.append(s)
        return {"format": FORMAT, "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "window": str(self.window), "time": time.time(), "main": self.main, "clock": self.clock,
                "threads": {str(k): v for k, v in dict(self.names).items()}, "fields": FIELDS,
                "groups": RECORDER.context()["groups"],
                "startup": list(self.startup), "steps": steps, "dropped_spans": self.dropped}

    def write(self, path: Path, close: bool = True) -> Path:
        """This rank's file (RUN/trace/rank-NNNN.json), written whole or not at all."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.snapshot(close), separators=(",", ":")))
        return path


class _Timed:
    __slots__ = ("tracer", "name", "args", "start")

    def __init__(self, tracer: Tracer, name: str, args: dict[str, Any]):
        self.tracer, self.name, self.args = tracer, name, args

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.tracer.span(self.name, self.start, time.perf_counter(), **self.args)


TRACER = Tracer()
