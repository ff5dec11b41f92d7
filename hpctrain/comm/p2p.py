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

Device tensors on an MPI that is not CUDA-aware go through host memory (copied to the host before a send,
received into a host buffer and copied to the device once complete).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

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
    """One posted send or receive: its MPI request, the tensor, and the host copy a staged one goes through."""

    __slots__ = ("request", "tensor", "host", "peer", "started")

    def __init__(self, request: Any, tensor: Any, host: Any, peer: int):
        self.request, self.tensor, self.host, self.peer = request, tensor, host, peer
        self.started = time.perf_counter()

    def finish(self) -> None:
        """After completion: a staged receive's bytes to the device tensor."""
        if self.host is not None and self.host is not self.tensor and self.tensor.is_cuda:
            self.tensor.copy_(self.host)
            self.host = None


def post_send(comm: Comm, tensor: Any, dest: int, tag: int) -> Transfer:
    """Start sending `tensor` (contiguous; kept alive by the Transfer until it completes) to rank `dest`."""
    MPI = load_mpi()
    host = tensor if _direct(tensor) else tensor.detach().cpu()
    spec = buffer_spec(host.detach(), MPI)
    return Transfer(comm.mpi.Isend(spec, dest=dest, tag=tag), tensor, host, dest)


def post_recv(comm: Comm, tensor: Any, source: int, tag: int) -> Transfer:
    """Start receiving into `tensor` (contiguous, of the size the sender sends) from rank `source`."""
    import torch

    MPI = load_mpi()
    host = tensor if _direct(tensor) else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    spec = buffer_spec(host, MPI)
    return Transfer(comm.mpi.Irecv(spec, source=source, tag=tag), tensor, host, source)


def wait_all(transfers: Iterable[Transfer]) -> None:
    """Complete every transfer: poll, spinning for SPIN_S, then sleeping SLEEP_S between polls."""
    transfers = list(transfers)
    if not transfers:
        return
    MPI = load_mpi()
    requests = [t.request for t in transfers]
    spin_until = time.perf_counter() + SPIN_S
    while not MPI.Request.Testall(requests):
        if time.perf_counter() > spin_until:
            time.sleep(SLEEP_S)
    for t in transfers:
        t.finish()


def allreduce_(comm: Comm, tensor: Any, op: str = "sum") -> Any:
    """Sum (op "sum") or take the maximum (op "max") of `tensor` over `comm`, in place; returns `tensor`.
    A 16-bit tensor is reduced in float32 and written back."""
    import torch

    if comm.size == 1:
        return tensor
    MPI = load_mpi()
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX}[op]
    wide = tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
    host = wide if _direct(wide) else wide.cpu()
    comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(host, MPI), op=mpi_op)
    if host is not tensor:
        tensor.copy_(host)
    return tensor


def send_object(comm: Comm, obj: Any, dest: int) -> None:
    """Send a small picklable object to rank `dest` (start-up agreements, not per-step data)."""
    comm.mpi.send(obj, dest=dest, tag=4)


def recv_object(comm: Comm, source: int) -> Any:
    """Receive what `send_object` sent from rank `source`."""
    return comm.mpi.recv(source=source, tag=4)
