"""The transfers of model-parallel runs: point-to-point sends of activations and their gradients between
pipeline stages, and in-place sums (and maxima) of activations over a tensor-parallel group.

- `post_send(comm, tensor, dest, tag)` and `post_recv(comm, tensor, source, tag)` start a nonblocking
  MPI_Isend / MPI_Irecv over the tensor's memory (no copy) and return a `Transfer`; `wait_all(transfers)`
  completes them. It polls (MPI_Testall) rather than blocking inside MPI: after a short spin it sleeps
  between polls, so a stage that waits gives its core back to the stage it waits for (ranks that share cores,
  as on an oversubscribed node, would otherwise slow the very rank they wait for). The caller names every
  wait to the watchdog before it starts one, so a stage that never sends is named, not a hang.
- `allreduce_(comm, tensor, op)`: an activation summed (or its maximum taken) over a communicator, in place;
  16-bit activations are summed in float32.

The flight recorder sees each of them through one hook: a transfer is recorded when it is posted (its
operation, e.g. "send activations", the peer as a rank of the run, the micro-batch, bytes and dtype) and ended
when `wait_all` sees it complete, and while `wait_all` waits the recorder knows which transfers this rank is
blocked on (a hang's line-up names the one a stage waits for and the rank that never sent it); each sum is a
collective of its communicator, named by `label` ("forward sum", "backward sum", ...) with the micro-batch the
pipeline is computing.

Device tensors on an MPI that is not CUDA-aware go through host memory (copied to the host before a send,
received into a host buffer and copied to the device once complete).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from ..trace.flight import RECORDER
from .wire import buffer_spec
from .world import Comm, cuda_aware, load_mpi

SPIN_S = 2e-4  # poll without sleeping this long (a transfer between neighbours on a node takes microseconds)
SLEEP_S = 2e-4  # then sleep this long between polls

_DIRECT: bool | None = None


def _direct(tensor: Any) -> bool:
    """Whether MPI reads and writes this tensor's memory itself (host memory, or a CUDA-aware MPI)."""
    global _DIRECT
    if not tensor.is_cuda:
        return True
    if _DIRECT is None:
        _DIRECT = bool(cuda_aware())
    return _DIRECT


class Transfer:
    """One posted send or receive: its MPI request, the tensor, the host copy a staged one goes through, and
    its flight record."""

    __slots__ = ("request", "tensor", "host", "peer", "seq")

    def __init__(self, request: Any, tensor: Any, host: Any, peer: int, seq: int):
        self.request, self.tensor, self.host, self.peer, self.seq = request, tensor, host, peer, seq

    def finish(self) -> None:
        """After completion: a staged receive's bytes to the device tensor."""
        if self.host is not None and self.host is not self.tensor and self.tensor.is_cuda:
            self.tensor.copy_(self.host)
            self.host = None


def post_send(comm: Comm, tensor: Any, dest: int, tag: int, what: str = "", micro: int = -1) -> Transfer:
    """Start sending `tensor` (contiguous; kept alive by the Transfer until it completes) to rank `dest`; the
    flight recorder calls it "send " + `what` of micro-batch `micro`."""
    MPI = load_mpi()
    host = tensor if _direct(tensor) else tensor.detach().cpu()
    spec = buffer_spec(host.detach(), MPI)
    seq = RECORDER.post("send " + what, comm.ranks[dest], tensor.dtype, tensor.numel() * tensor.element_size(),
                        comm.flight, micro)
    return Transfer(comm.mpi.Isend(spec, dest=dest, tag=tag), tensor, host, dest, seq)


def post_recv(comm: Comm, tensor: Any, source: int, tag: int, what: str = "", micro: int = -1) -> Transfer:
    """Start receiving into `tensor` (contiguous, of the size the sender sends) from rank `source`; the flight
    recorder calls it "recv " + `what` of micro-batch `micro`."""
    import torch

    MPI = load_mpi()
    host = tensor if _direct(tensor) else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    spec = buffer_spec(host, MPI)
    seq = RECORDER.post("recv " + what, comm.ranks[source], tensor.dtype, tensor.numel() * tensor.element_size(),
                        comm.flight, micro)
    return Transfer(comm.mpi.Irecv(spec, source=source, tag=tag), tensor, host, source, seq)


def wait_all(transfers: Iterable[Transfer]) -> None:
    """Complete every transfer: poll, spinning for SPIN_S, then sleeping SLEEP_S between polls."""
    transfers = list(transfers)
    if not transfers:
        return
    MPI = load_mpi()
    requests = [t.request for t in transfers]
    spin_until = time.perf_counter() + SPIN_S
    RECORDER.blocked = tuple(t.seq for t in transfers)
    try:
        while not MPI.Request.Testall(requests):
            if time.perf_counter() > spin_until:
                time.sleep(SLEEP_S)
    finally:
        RECORDER.blocked = ()
    for t in transfers:
        RECORDER.end(t.seq)
        t.finish()


def allreduce_(comm: Comm, tensor: Any, op: str = "sum", label: str = "allreduce") -> Any:
    """Sum (op "sum") or take the maximum (op "max") of `tensor` over `comm`, in place; returns `tensor`.
    A 16-bit tensor is reduced in float32 and written back. `label`: the flight recorder's name for it."""
    import torch

    if comm.size == 1:
        return tensor
    MPI = load_mpi()
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX}[op]
    wide = tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
    host = wide if _direct(wide) else wide.cpu()
    seq = RECORDER.begin(label, -1, wide.dtype, wide.numel() * wide.element_size(), group=comm.flight,
                         micro=RECORDER.micro)
    try:
        comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(host, MPI), op=mpi_op)
    finally:
        RECORDER.end(seq)
    if host is not tensor:
        tensor.copy_(host)
    return tensor


def send_object(comm: Comm, obj: Any, dest: int) -> None:
    """Send a small picklable object to rank `dest` (start-up agreements, not per-step data)."""
    comm.mpi.send(obj, dest=dest, tag=4)


def recv_object(comm: Comm, source: int) -> Any:
    """Receive what `send_object` sent from rank `source`."""
    return comm.mpi.recv(source=source, tag=4)
