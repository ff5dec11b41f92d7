"""The pipeline schedule: M micro-batches through P stages, forward and backward, with activations and their
gradients sent between neighbour stages by MPI_Isend/MPI_Irecv.

`schedule(kind, stage, stages, micro)` is the order of one stage's operations, a pure function:
- `1f1b` (PipeDream-Flush, as Megatron-LM runs it): stage p first runs P - p - 1 forwards (warm-up), then
  alternates one forward and one backward, then runs the remaining backwards; at most P - p micro-batches'
  activations are alive at once.
- `gpipe`: every forward, then every backward (the reference: M micro-batches' activations alive at once).
Both leave (P - 1) / (M + P - 1) of each stage's time idle when stages take equal time (the bubble).

`Pipeline` runs a schedule on one rank. The shape of what crosses each stage boundary is agreed once, at
start-up (`agree_shapes`: each stage runs its forward on one row and tells the next what came out); a step
then knows every transfer's size from the number of rows of each micro-batch, which every rank of a replica
reads itself (they read the same rows), so nothing but the tensors themselves is sent per step. The
receive of the next operation is posted before the current one computes. Every wait names the stage and
rank it waits for to the watchdog (a stage that never sends is named, not a hang). The step's own
timestamps give each stage's busy and idle time (`Timing`: what `bench train --pp` reports as the bubble).
Each transfer is a flight record (`comm.p2p`), so after a hang the line-up names the transfer a stage waits
for and the rank that never sent it; with `--trace`, each micro-batch's forward and backward and each wait for
a neighbour is a span of the timeline (the bubble, visible).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from ..base.errors import ConfigError
from ..comm.p2p import Transfer, post_recv, post_send, recv_object, send_object, wait_all
from ..trace.flight import RECORDER
from ..trace.spans import TRACER
from .groups import Groups
from .stages import Stage

SCHEDULES = ("1f1b", "gpipe")
Op = tuple[str, int]  # ("F" or "B", micro-batch)
# MPI tags of the transfers: messages between two ranks with one tag arrive in the order they were sent, and
# every stage runs its micro-batches in the same order as its neighbours, so the tag need only say what it is
ACTIVATION, GRADIENT, EVAL_TAG = 1, 2, 3
_WHAT = {ACTIVATION: "activations", GRADIENT: "activation gradients", EVAL_TAG: "validation activations"}  # records
_NAMES = {"F": "forward", "B": "backward"}


def schedule(kind: str, stage: int, stages: int, micro: int) -> list[Op]:
    """The operations of `stage` (of `stages`) over `micro` micro-batches, in order."""
    if kind == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in reversed(range(micro))]
    if kind != "1f1b":
        raise ConfigError(f"--pipeline-schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    warm = min(stages - stage - 1, micro)
    ops: list[Op] = [("F", i) for i in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - warm, micro)]


def expected_bubble(stages: int, micro: int) -> float:
    """The idle share of each stage's step with equal stage times and free transfers: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro + stages - 1)


@dataclass(slots=True)
class Timing:
    """Seconds of one rank's last pipeline step: the whole schedule, its forward and backward compute, and
    the waits for a neighbour's transfer."""

    wall: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    wait: float = 0.0

    @property
    def busy(self) -> float:
        return self.forward + self.backward


@dataclass(slots=True)
class Pipeline:
    """One rank's stage of a pipeline and how it runs a step (see the module docstring)."""

    stage: Stage
    groups: Groups
    kind: str = "1f1b"
    device: Any = "cpu"
    autocast: Callable[[], Any] = field(default=None)  # type: ignore[assignment]
    watchdog: Any = None
    out_row: tuple[int, ...] = ()  # what this stage sends per row: shape and dtype
    out_dtype: Any = torch.float32
    in_row: tuple[int, ...] = ()
    in_dtype: Any = torch.float32
    timing: Timing = field(default_factory=Timing)

    def agree_shapes(self, row: Any) -> None:
        """Learn, once, what crosses each boundary: the first stage runs its forward on one row like `row`
        (numpy, as the reader gives it), tells the next stage the output's shape and dtype per row, and so on
        down the pipeline (a chain of small messages; the tensor-parallel ranks of a stage run it together)."""
        g = self.groups
        with torch.no_grad():
            if g.first:
                x = self._input(row[None])
            else:
                self.in_row, self.in_dtype = recv_object(g.pipe, g.p - 1)
                x = torch.zeros((1, *self.in_row), dtype=self.in_dtype, device=self.device)
            if not g.last:
                with self._autocast():
                    out = self.stage(x)
                self.out_row, self.out_dtype = tuple(out.shape[1:]), out.dtype
                send_object(g.pipe, (self.out_row, self.out_dtype), g.p + 1)

    def _autocast(self) -> Any:
        import contextlib

        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def _input(self, x: Any) -> torch.Tensor:
        xt = torch.from_numpy(x).to(self.device, non_blocking=True)
        return xt if xt.dtype in (torch.float32, torch.int64) else xt.float()

    def step(self, x: Any, y: Any, bounds: list[int], scale: float, *, step: int = 0,
             last_backward: Callable[[], None] | None = None) -> float:
        """Run one step's schedule over the micro-batches rows [bounds[i], bounds[i+1]) of the batch (x, y),
        backward from loss x `scale`; `last_backward` runs before this stage's last backward (where the
        gradient sync starts). Returns the summed loss on the last stage (0 elsewhere).

        Each operation names itself to the watchdog (the stage, forward or backward, the micro-batch: its
        tensor-parallel sums are collective waits) and to the flight recorder (the micro-batch its transfers
        and sums belong to), and is a span of the timeline with its micro-batch; so is each wait for a
        neighbour. The wait the step was called in (the trainer's "gradient allreduce") is restored after each."""
        g = self.groups
        started = time.perf_counter()
        self.timing = Timing()
        rows = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        ops = [op for op in schedule(self.kind, g.p, g.layout.pipe, len(rows)) if rows[op[1]]]
        posted: dict[Op, Transfer] = {}
        sends: list[Transfer] = []
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = 0.0
        last_b = max((k for k, op in enumerate(ops) if op[0] == "B"), default=-1)
        try:
            for k, (kind, i) in enumerate(ops):
                RECORDER.micro = i
                with self._waiting(f"pipeline stage {g.p} computing the {_NAMES[kind]} of micro-batch {i}", step):
                    for ahead in ops[k:k + 2]:
                        self._post(ahead, rows[ahead[1]], posted)
                    lo, hi = bounds[i], bounds[i + 1]
                    if kind == "F":
                        loss_sum += self._forward(i, x[lo:hi], y[lo:hi], posted, sends, saved, step)
                    else:
                        self._backward(i, scale, posted, sends, saved, step, last_backward if k == last_b else None)
            RECORDER.micro = -1
            self._wait(sends, "its sends to finish", step)
        finally:
            RECORDER.micro = -1
        self.timing.wall = time.perf_counter() - started
        return loss_sum

    def _forward(self, i: int, x: Any, y: Any, posted: dict[Op, Transfer], sends: list[Transfer],
                 saved: dict[int, tuple[torch.Tensor, torch.Tensor]], step: int) -> float:
        """The forward of micro-batch `i` (rows x, y): its loss on the last stage (0 elsewhere)."""
        g = self.groups
        inp = self._input(x) if g.first else self._received(("F", i), posted, step)
        if not g.first:
            inp.requires_grad_(True)
        t0 = time.perf_counter()
        with self._autocast():
            out = self.stage(inp)
        loss = 0.0
        if g.last:
            out = self.stage.loss(out, torch.from_numpy(y).to(self.device))
            loss = float(out.detach())
        self.timing.forward += time.perf_counter() - t0
        if not g.last:
            sends.append(post_send(g.pipe, out.detach().contiguous(), g.p + 1, ACTIVATION, _WHAT[ACTIVATION], i))
        saved[i] = (inp, out)
        TRACER.span("forward", t0, time.perf_counter(), micro=i)
        return loss

    def _backward(self, i: int, scale: float, posted: dict[Op, Transfer], sends: list[Transfer],
                  saved: dict[int, tuple[torch.Tensor, torch.Tensor]], step: int,
                  last_backward: Callable[[], None] | None) -> None:
        """The backward of micro-batch `i` (from loss x `scale` on the last stage); `last_backward` first."""
        g = self.groups
        inp, out = saved.pop(i)
        grad = None if g.last else self._received(("B", i), posted, step)
        if last_backward is not None:
            last_backward()
        t0 = time.perf_counter()
        if g.last:
            (out * scale).backward()
        else:
            torch.autograd.backward(out, grad)
        self.timing.backward += time.perf_counter() - t0
        if not g.first:
            sends.append(post_send(g.pipe, inp.grad.contiguous(), g.p - 1, GRADIENT, _WHAT[GRADIENT], i))
        TRACER.span("backward", t0, time.perf_counter(), micro=i)

    def forward_only(self, x: Any, *, step: int = 0) -> torch.Tensor | None:
        """One batch forward through the pipeline without gradients (validation); the last stage's output on
        the last stage, None elsewhere."""
        g = self.groups
        with torch.no_grad():
            if g.first:
                inp = self._input(x)
            else:
                inp = torch.empty((len(x), *self.in_row), dtype=self.in_dtype, device=self.device)
                self._wait([post_recv(g.pipe, inp, g.p - 1, EVAL_TAG, _WHAT[EVAL_TAG])],
                           f"stage {g.p - 1} (rank {g.stage_rank(g.p - 1)}) to send validation activations", step)
            with self._autocast():
                out = self.stage(inp)
            if g.last:
                return out
            self._wait([post_send(g.pipe, out.contiguous(), g.p + 1, EVAL_TAG, _WHAT[EVAL_TAG])], "its validation send",
                       step)
            return None

    def _post(self, op: Op, rows: int, posted: dict[Op, Transfer]) -> None:
        """Post the receive `op` needs (an activation from the stage before, a gradient from the one after)."""
        g = self.groups
        kind, i = op
        if op in posted or (kind == "F" and g.first) or (kind == "B" and g.last):
            return
        if kind == "F":
            buf = torch.empty((rows, *self.in_row), dtype=self.in_dtype, device=self.device)
            posted[op] = post_recv(g.pipe, buf, g.p - 1, ACTIVATION, _WHAT[ACTIVATION], i)
        else:
            buf = torch.empty((rows, *self.out_row), dtype=self.out_dtype, device=self.device)
            posted[op] = post_recv(g.pipe, buf, g.p + 1, GRADIENT, _WHAT[GRADIENT], i)

    def _received(self, op: Op, posted: dict[Op, Transfer], step: int) -> torch.Tensor:
        g = self.groups
        peer = g.p - 1 if op[0] == "F" else g.p + 1
        what = _WHAT[ACTIVATION if op[0] == "F" else GRADIENT]
        transfer = posted.pop(op)
        self._wait([transfer], f"stage {peer} (rank {g.stage_rank(peer)}) to send the {what} of micro-batch {op[1]}",
                   step, op[1])
        return transfer.tensor

    def _waiting(self, what: str, step: int) -> ContextManager[None]:
        """The watchdog's wait `what` for a block (the control layer's `Watchdog.waiting`; none without one)."""
        return contextlib.nullcontext() if self.watchdog is None else self.watchdog.waiting(what, step)

    def _wait(self, transfers: list[Transfer], what: str, step: int, micro: int = -1) -> None:
        """Wait for `transfers` (named to the watchdog as waiting for `what`), a span of the timeline."""
        if not transfers:
            return
        t0 = time.perf_counter()
        with self._waiting(f"pipeline stage {self.groups.p} waiting for {what}", step):
            wait_all(transfers)
        t1 = time.perf_counter()
        self.timing.wait += t1 - t0
        TRACER.span("pipeline wait", t0, t1, micro=micro, waiting_for=what)
