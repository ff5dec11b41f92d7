"""A model's buffers kept equal on every rank: rank 0's, broadcast once per step.

Buffers (BatchNorm's running mean, variance and count of batches; any tensor a module registers with
`register_buffer`) are state that forward changes, not the optimizer: each rank updates them from its own batch,
so without a broadcast the replicas drift apart, a checkpoint holds one rank's mean beside another's variance and
the run ends with ranks that disagree. As under DDP's `broadcast_buffers=True` (its default), rank 0's buffers are
the model's: the gradient engine broadcasts them at the end of every step's reduction (`GradSync.wait`, after the
step's forwards), so each forward starts from rank 0's buffers as it does under DDP, and between steps, where a
validation pass, a checkpoint and the end-of-run check read them, every rank holds the same ones.

All buffers travel in one message: their bytes packed into one flat tensor (any dtype: float statistics, int64
counters, bool masks), one Bcast, unpacked on the other ranks. A model without buffers costs nothing.
"""

from __future__ import annotations

from typing import Any

from ..trace.flight import RECORDER
from .wire import buffer_spec
from .world import Comm, load_mpi


def buffer_slots(module: Any) -> list[tuple[Any, str]]:
    """(module, name) of every buffer registered in `module` and its submodules: found once, when the engine is
    built, since walking a model's modules at every step costs more than the broadcast itself. Read through its
    slot, a buffer that a module replaces (`self.buf = tensor`) is still the one sent."""
    if module is None:
        return []
    return [(m, name) for m in module.modules() for name, _ in m.named_buffers(recurse=False)]


def _current(slots: list[tuple[Any, str]]) -> list[Any]:
    """The non-empty buffers in `slots` now, each once, widest dtype first: packed in this order, each lies in the
    flat message at an offset its element size divides, so it is read back by a view."""
    found: dict[int, Any] = {}
    for module, name in slots:
        buffer = getattr(module, name, None)
        if buffer is not None and buffer.numel():
            found.setdefault(id(buffer), buffer)
    return sorted(found.values(), key=lambda b: -b.element_size())


def broadcast_buffers(comm: Comm, slots: list[tuple[Any, str]], *, staged: bool = False, root: int = 0) -> None:
    """Give every rank `root`'s buffers (in `slots`, from `buffer_slots`: the same on every rank), in place, in
    one Bcast of their bytes. Collective; nothing at all in a world of one or without buffers. `staged`: device
    memory goes to MPI through a host copy (an MPI that is not CUDA-aware)."""
    import torch

    buffers = _current(slots)
    if comm.size == 1 or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
    if flat.is_cuda and staged:
        flat = flat.cpu()
    seq = RECORDER.begin("bcast", nbytes=flat.numel(), group=comm.flight)
    try:
        comm.mpi.Bcast(buffer_spec(flat, load_mpi()), root=root)
    finally:
        RECORDER.end(seq)
    if comm.rank == root:
        return
    at = 0
    for b in buffers:
        n = b.numel() * b.element_size()
        b.detach().copy_(flat[at:at + n].view(b.dtype).view(b.shape))
        at += n
