"""Handles of asynchronous operations and the requests behind them (Horovod's handle manager).

A handle is an int, as in Horovod. Unnamed operations are named after their handle (`allreduce.noname.7`),
named ones after their name (`allreduce.grad.fc1.weight`): ranks match operations by these names, so they
must consume handles alike, as Horovod's ranks do.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from ..comm.negotiate import Entry, Request
from .basics import ProcessSet, global_process_set

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}

_COUNTER = itertools.count(1)
_HANDLES: dict[int, "Handle"] = {}
_LOCK = threading.Lock()


class HorovodInternalError(RuntimeError):
    """A collective failed inside hpctrain.horovod (Horovod's exception of the same name)."""


class Handle:
    """The entries of one asynchronous call and how to turn their results into what the call returns."""

    __slots__ = ("entries", "post")

    def __init__(self, entries: list[Entry], post: Callable[[list[Any]], Any]):
        self.entries = entries
        self.post = post


def new_handle() -> int:
    return next(_COUNTER)


def op_name(prefix: str, name: str | None, handle: int) -> str:
    return f"{prefix}.{name}" if name else f"{prefix}.noname.{handle}"


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def reduce_op(op: int, process_set: ProcessSet, kind: str) -> tuple[str, int]:
    """(MPI op, divisor) of a Horovod reduction op."""
    if op == Adasum:
        raise NotImplementedError(f"hvd.Adasum is not supported by hpctrain.horovod ({kind}); use hvd.Average or "
                                  "hvd.Sum (docs/horovod.md says why)")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return _OP_NAMES[op], (process_set.size() or 1) if op == Average else 1


def request_for(kind: str, name: str, tensor: Any, **fields: Any) -> Request:
    return Request(name=name, kind=kind, dtype=dtype_name(tensor), shape=tuple(tensor.shape),
                   device="cuda" if tensor.is_cuda else "cpu", **fields)


def submit(process_set: ProcessSet, entries: list[Entry], post: Callable[[list[Any]], Any], handle: int) -> int:
    """Hand `entries` to the process set's negotiation thread; `handle` then stands for them."""
    group = process_set.require()
    submitted = []
    try:
        for entry in entries:
            submitted.append(group.submit(entry))
    except BaseException:
        if submitted:  # a group half submitted: the rest would never match; fail what went in
            with _LOCK:
                _HANDLES[handle] = Handle(submitted, post)
        raise
    with _LOCK:
        _HANDLES[handle] = Handle(entries, post)
    return handle


def poll(handle: int) -> bool:
    """True when the operation behind `handle` has completed (then `synchronize` returns at once)."""
    with _LOCK:
        found = _HANDLES.get(handle)
    if found is None:
        raise ValueError(f"unknown handle {handle!r}: it was never issued or was synchronized already")
    return all(entry.done.is_set() for entry in found.entries)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle`; return its result, or raise its error (on every rank that took
    part, for a mismatch)."""
    with _LOCK:
        found = _HANDLES.pop(handle, None)
    if found is None:
        raise ValueError(f"unknown handle {handle!r}: it was never issued or was synchronized already")
    for entry in found.entries:
        while not entry.done.wait(1.0):  # bounded waits: Ctrl-C and the stall inspector stay live
            pass
    errors = [entry.error for entry in found.entries if entry.error is not None]
    if errors:
        raise errors[0]
    return found.post([entry.result for entry in found.entries])


def join_entry(device: int) -> Entry:
    return Entry(Request(name="join", kind="join"))


def barrier_entry(process_set: ProcessSet) -> Entry:
    process_set.barriers += 1
    return Entry(Request(name=f"barrier.{process_set.barriers}", kind="barrier"))


__all__ = ["Adasum", "Average", "Handle", "HorovodInternalError", "Max", "Min", "Product", "Sum",
           "global_process_set", "new_handle", "op_name", "poll", "reduce_op", "request_for", "submit",
           "synchronize"]
