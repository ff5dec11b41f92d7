"""Horovod's collectives (`horovod.torch.mpi_ops`), names and argument order as in Horovod 0.28.1.

Each has a blocking form, an in-place form (`_`) and asynchronous forms (`_async`, `_async_`) returning a
handle for `poll` and `synchronize`. The blocking out-of-place forms are differentiable (autograd.py).
"""

from __future__ import annotations

import warnings
from typing import Any

from ..comm.negotiate import Entry
from .basics import ProcessSet, global_process_set
from .handles import (Adasum, Average, Max, Min, Product, Sum, barrier_entry, join_entry, new_handle, op_name,
                      poll, reduce_op, request_for, submit, synchronize)


def average_compat(op: int | None, average: bool | None) -> int:
    """Horovod's deprecated `average=` argument: True is Average, False is Sum; op and average are exclusive."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; give only one of them")
    if average is not None:
        warnings.warn("parameter `average` has been replaced with `op` and will be removed in a future release",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _empty_like(tensor: Any) -> Any:
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _reduce_entries(kind: str, tensors: list[Any], outputs: list[Any], names: list[str], op: int,
                    prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> list[Entry]:
    mpi_op, divisor = reduce_op(op, process_set, kind)
    return [Entry(request_for(kind, name, t, op=mpi_op, divisor=divisor, prescale=float(prescale_factor),
                              postscale=float(postscale_factor)), t, out)
            for t, out, name in zip(tensors, outputs, names)]


def _group_names(prefix: str, name: str | None, handle: int, n: int) -> list[str]:
    base = op_name(prefix, name, handle)
    return [f"{base}_{i}" for i in range(n)]


# -- allreduce -------------------------------------------------------------------------------------
def _allreduce_async(tensor: Any, output: Any, name: str | None, op: int, prescale_factor: float,
                     postscale_factor: float, process_set: ProcessSet) -> int:
    handle = new_handle()
    entries = _reduce_entries("allreduce", [tensor], [output], [op_name("allreduce", name, handle)], op,
                              prescale_factor, postscale_factor, process_set)
    return submit(process_set, entries, lambda results: results[0], handle)


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    op = average_compat(op, average)
    return _allreduce_async(tensor, _empty_like(tensor), name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    op = average_compat(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_async(kind: str, tensors: list[Any], outputs: list[Any], name: str | None, op: int,
                   prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    handle = new_handle()
    names = _group_names(f"grouped_{kind}", name, handle, len(tensors))
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"grouped {kind}: the tensors must share one device (found {sorted(map(str, devices))})")
    entries = _reduce_entries(kind, tensors, outputs, names, op, prescale_factor, postscale_factor, process_set)
    return submit(process_set, entries, list, handle)


def grouped_allreduce_async(tensors: list[Any], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    op = average_compat(op, average)
    return _grouped_async("allreduce", list(tensors), [_empty_like(t) for t in tensors], name, op,
                          prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors: list[Any], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    op = average_compat(op, average)
    return _grouped_async("allreduce", list(tensors), list(tensors), name, op, prescale_factor, postscale_factor,
                          process_set)


def grouped_allreduce_(tensors: list[Any], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: Any, name: str, op: int, process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce of a sparse tensor as an allgather of its indices and values; returns a callable that waits
    and gives the (uncoalesced) sparse result."""
    indices_handle = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                                     process_set=process_set)
    values_handle = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def wait() -> Any:
        indices = synchronize(indices_handle)
        values = synchronize(values_handle)
        if op == Average:
            values = values / process_set.size()
        import torch

        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, tensor.size())

    return wait


# -- allgather, broadcast, alltoall ------------------------------------------------------------------
def allgather_async(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    handle = new_handle()
    entry = Entry(request_for("allgather", op_name("allgather", name, handle), tensor), tensor, None)
    return submit(process_set, [entry], lambda results: results[0], handle)


def grouped_allgather_async(tensors: list[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    handle = new_handle()
    names = _group_names("grouped_allgather", name, handle, len(tensors))
    entries = [Entry(request_for("allgather", n, t), t, None) for t, n in zip(tensors, names)]
    return submit(process_set, entries, list, handle)


def _broadcast_async(tensor: Any, output: Any, root_rank: int, name: str | None, process_set: ProcessSet) -> int:
    handle = new_handle()
    entry = Entry(request_for("broadcast", op_name("broadcast", name, handle), tensor, root=int(root_rank)),
                  tensor, output)
    return submit(process_set, [entry], lambda results: results[0], handle)


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_async(tensor, _empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Send `splits[i]` rows (first dimension) to member i; without splits, equal parts. Its handle gives
    (received tensor, received splits)."""
    import torch

    members = process_set.size() or 1
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % members:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the set's size "
                             f"({rows} rows, {members} ranks)")
        sent = [rows // members] * members
    else:
        splits = torch.as_tensor(splits)
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be 32-bit integers (torch.int32), not {splits.dtype}")
        sent = [int(s) for s in splits.cpu().tolist()]
        if len(sent) != members or sum(sent) > rows or min(sent, default=0) < 0:
            raise ValueError(f"alltoall splits {sent}: need {members} non-negative entries summing to at most "
                             f"the {rows} rows of the tensor")
    handle = new_handle()
    entry = Entry(request_for("alltoall", op_name("alltoall", name, handle), tensor, splits=tuple(sent)), tensor,
                  None)
    return submit(process_set, [entry], lambda results: results[0], handle)


# -- reducescatter ---------------------------------------------------------------------------------
def _check_scatterable(tensor: Any) -> None:
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension, not a scalar")


def reducescatter_async(tensor: Any, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    _check_scatterable(tensor)
    handle = new_handle()
    entries = _reduce_entries("reducescatter", [tensor], [None], [op_name("reducescatter", name, handle)], op,
                              prescale_factor, postscale_factor, process_set)
    return submit(process_set, entries, lambda results: results[0], handle)


def grouped_reducescatter_async(tensors: list[Any], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    for tensor in tensors:
        _check_scatterable(tensor)
    return _grouped_async("reducescatter", list(tensors), [None] * len(tensors), name, op, prescale_factor,
                          postscale_factor, process_set)


# -- join and barrier ---------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """This rank has no more work: it contributes zeros to other ranks' allreduces until every rank has
    joined; returns the last rank to join (the same on every rank)."""
    handle = new_handle()
    return synchronize(submit(global_process_set, [join_entry(device)], lambda results: results[0], handle))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member of `process_set` has reached this barrier."""
    handle = new_handle()
    synchronize(submit(process_set, [barrier_entry(process_set)], lambda results: None, handle))


__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather_async", "allreduce_", "allreduce_async",
           "allreduce_async_", "alltoall_async", "barrier", "broadcast_", "broadcast_async", "broadcast_async_",
           "grouped_allgather_async", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "grouped_reducescatter_async", "join", "poll", "reducescatter_async", "sparse_allreduce_async",
           "synchronize"]
