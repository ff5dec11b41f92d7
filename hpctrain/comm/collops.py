"""The data collectives of negotiated operations (negotiate.py), run once every member has submitted them.

Every member runs the same ready list in the same order: each operation's nonblocking MPI call is started in
that order, then all are polled to completion together, then results are scaled and handed back. Allreduces
of one dtype, op and scaling that became ready together are fused into one buffer (Horovod's tensor fusion)
up to the fusion threshold; a lone contiguous in-place allreduce runs in the tensor's own memory.

Sums of 16-bit floats are computed in float32 (MPI has no half type), as Horovod does on the CPU; integer
tensors are scaled in float64 and truncated back. Device tensors are staged through host memory.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .world import load_mpi

_WIDE = {"float16": "float32", "bfloat16": "float32"}
ALONE_BYTES = 1 << 18  # as GradSync.OWN_BYTES: measured on the reference MLP (docs/performance.md, the step against the honest limit)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _mpi_op(op: str, MPI: Any) -> Any:
    return {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op]


def _host(tensor: Any) -> Any:
    return tensor.detach().cpu() if tensor.is_cuda else tensor.detach()


def _bytes(tensor: Any) -> Any:
    """A uint8 numpy view of a contiguous CPU tensor (any dtype)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def _scale(buf: Any, factor: float, divisor: int, integral: bool) -> Any:
    """Multiply by `factor` and divide by `divisor`; integers in float64, truncated (as Horovod does)."""
    import torch

    if factor == 1.0 and divisor == 1:
        return buf
    if integral:
        wide = buf.to(torch.float64) * factor
        if divisor != 1:
            wide = wide / divisor
        return wide.to(buf.dtype)
    if factor != 1.0:
        buf.mul_(factor)
    if divisor != 1:
        buf.div_(divisor)
    return buf


def _fusable(a: Any, b: Any) -> bool:
    return (a.kind == b.kind == "allreduce" and a.dtype == b.dtype and a.op == b.op and a.prescale == b.prescale
            and a.postscale == b.postscale and a.divisor == b.divisor and a.device == b.device)


def _groups(runnable: list[tuple[Any, Any, Any]], fusion_bytes: int) -> list[list[tuple[Any, Any, Any]]]:
    """Consecutive fusable allreduces share one buffer up to `fusion_bytes`; one of at least `ALONE_BYTES` is
    reduced alone, in its own memory when in place (copying it into a fusion buffer costs more than a
    collective of its own)."""
    groups: list[list[tuple[Any, Any, Any]]] = []
    size, last_alone = 0, False
    for item in runnable:
        request = item[0]
        nbytes = (int(np.prod(request.shape, dtype=np.int64)) * torch_dtype(request.dtype).itemsize
                  if request.kind == "allreduce" else 0)
        alone = nbytes >= ALONE_BYTES
        if (groups and not alone and not last_alone and _fusable(groups[-1][0][0], request)
                and size + nbytes <= fusion_bytes):
            groups[-1].append(item)
            size += nbytes
        else:
            groups.append([item])
            size = nbytes
        last_alone = alone
    return groups


def run_ready(comm: Any, member: int, ranks: list[int], runnable: list[tuple[Any, Any, Any]], fusion_bytes: int,
              wait: Callable[[Any], None]) -> None:
    """Run `runnable` [(request, {member: request}, this rank's Entry or None)] on `comm`, in order."""
    MPI = load_mpi()
    started = []
    for group in _groups(runnable, fusion_bytes):
        kind = group[0][0].kind
        try:
            if kind == "allreduce":
                started.append(_start_allreduce(comm, group, MPI))
            else:
                request, got, entry = group[0]
                start = {"allgather": _start_allgather, "broadcast": _start_broadcast, "alltoall": _start_alltoall,
                         "reducescatter": _start_reducescatter, "barrier": _start_barrier}[kind]
                started.append(start(comm, member, ranks, request, got, entry, MPI))
        except Exception as exc:  # noqa: BLE001 - a local failure; the collective was not started
            for _, _, entry in group:
                if entry is not None:
                    entry.finish(error=exc)
    for mpi_request, finish, _buffers in started:  # the buffers stay referenced until MPI is done with them
        if mpi_request is not None:
            wait(mpi_request)
        finish()


def _start_allreduce(comm: Any, group: list[tuple[Any, Any, Any]], MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    import torch

    request = group[0][0]
    dtype = torch_dtype(request.dtype)
    wide = torch_dtype(_WIDE.get(request.dtype, request.dtype))
    integral = not dtype.is_floating_point
    entries = [entry for _, _, entry in group]
    inputs = [(_host(e.tensor).reshape(-1) if e is not None else torch.zeros(int(np.prod(r.shape)), dtype=dtype))
              for (r, _, _), e in zip(group, entries)]
    lone = (len(group) == 1 and entries[0] is not None and entries[0].output is entries[0].tensor
            and not entries[0].tensor.is_cuda and entries[0].tensor.is_contiguous() and wide == dtype)
    if lone:
        flat = entries[0].tensor.detach().view(-1)
    else:
        flat = torch.cat([t.to(wide) for t in inputs]) if len(inputs) > 1 else inputs[0].to(wide, copy=True)
    flat = _scale(flat, request.prescale, 1, integral)
    mpi_request = comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), op=_mpi_op(request.op, MPI))

    def finish() -> None:
        result = _scale(flat, request.postscale, request.divisor, integral)
        offset = 0
        for (r, _, _), entry in zip(group, entries):
            n = int(np.prod(r.shape, dtype=np.int64))
            if entry is not None:
                chunk = result[offset:offset + n]
                if chunk.data_ptr() != entry.output.data_ptr() or entry.output.is_cuda:
                    entry.output.copy_(chunk.view(r.shape))
                entry.finish(entry.output)
            offset += n

    return mpi_request, finish, (flat,)


def _start_allgather(comm: Any, member: int, ranks: list[int], request: Any, got: dict[int, Any], entry: Any,
                     MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    import torch

    dtype = torch_dtype(request.dtype)
    shape = request.shape or (1,)
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    rows = [(got[m].shape or (1,))[0] for m in range(len(ranks))]
    out = torch.empty((sum(rows),) + tuple(shape[1:]), dtype=dtype)
    send = _host(entry.tensor).contiguous()
    counts = [r * row for r in rows]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    mpi_request = comm.Iallgatherv(_bytes(send), [_bytes(out), counts, displs, MPI.BYTE])

    def finish() -> None:
        entry.finish(out.to(entry.tensor.device) if entry.tensor.is_cuda else out)

    return mpi_request, finish, (send, out)


def _start_broadcast(comm: Any, member: int, ranks: list[int], request: Any, got: dict[int, Any], entry: Any,
                     MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    root = ranks.index(request.root)
    target = entry.output
    if member == root and target is not entry.tensor:
        target.copy_(entry.tensor.detach())
    buf = _host(target).contiguous()  # the output's own memory on the CPU
    mpi_request = comm.Ibcast(_bytes(buf), root=root)

    def finish() -> None:
        if buf.data_ptr() != target.data_ptr():
            target.copy_(buf.view(target.shape))
        entry.finish(target)

    return mpi_request, finish, (buf,)


def _start_alltoall(comm: Any, member: int, ranks: list[int], request: Any, got: dict[int, Any], entry: Any,
                    MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    import torch

    dtype = torch_dtype(request.dtype)
    shape = request.shape
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    received = [got[m].splits[member] for m in range(len(ranks))]
    out = torch.empty((sum(received),) + tuple(shape[1:]), dtype=dtype)
    send = _host(entry.tensor).contiguous()
    scounts = [s * row for s in got[member].splits]
    rcounts = [r * row for r in received]
    sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).tolist()
    rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).tolist()
    mpi_request = comm.Ialltoallv([_bytes(send), scounts, sdispl, MPI.BYTE], [_bytes(out), rcounts, rdispl, MPI.BYTE])

    def finish() -> None:
        splits = torch.tensor(received, dtype=torch.int32)
        entry.finish((out.to(entry.tensor.device) if entry.tensor.is_cuda else out, splits))

    return mpi_request, finish, (send, out)


def scatter_rows(rows: int, size: int) -> list[int]:
    """How reducescatter splits the first dimension: as evenly as possible, the first ranks one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _start_reducescatter(comm: Any, member: int, ranks: list[int], request: Any, got: dict[int, Any], entry: Any,
                         MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    import torch

    dtype = torch_dtype(request.dtype)
    wide = torch_dtype(_WIDE.get(request.dtype, request.dtype))
    integral = not dtype.is_floating_point
    row = int(np.prod(request.shape[1:], dtype=np.int64))
    mine = scatter_rows(request.shape[0], len(ranks))
    flat = _host(entry.tensor).reshape(-1).to(wide, copy=True)
    flat = _scale(flat, request.prescale, 1, integral)
    out = torch.empty((mine[member],) + tuple(request.shape[1:]), dtype=wide)
    mpi_request = comm.Ireduce_scatter(flat.numpy(), out.reshape(-1).numpy(), [r * row for r in mine],
                                       op=_mpi_op(request.op, MPI))

    def finish() -> None:
        result = _scale(out, request.postscale, request.divisor, integral).to(dtype)
        entry.finish(result.to(entry.tensor.device) if entry.tensor.is_cuda else result)

    return mpi_request, finish, (flat, out)


def _start_barrier(comm: Any, member: int, ranks: list[int], request: Any, got: dict[int, Any], entry: Any,
                   MPI: Any) -> tuple[Any, Callable[[], None], tuple[Any, ...]]:
    return None, lambda: entry.finish(None) if entry is not None else None, ()
