"""Handles of asynchronous operations and the requests behind them (Horovod's handle manager).

A handle is an int, as in Horovod. Unnamed operations are named after their handle (`allreduce.noname.7`),
named ones after their name (`allreduce.grad.fc1.weight`): ranks match operations by these names, so they
must consume handles alike, as Horovod's ranks do.

A name submitted again before the operation under it is synchronized raises `ValueError` at once, as
Horovod's does for a name "currently being processed". Horovod frees the name when the operation completes,
so whether a quick second submission raises depends on how fast the others were: under load the first can
complete in between, the second is then accepted, and it waits forever for a partner that already met the
first (Horovod's own duplicate-name tests hung so against hpctrain.horovod). Here the name stays taken until
the submitting rank synchronizes its handle; a handle given up on (say after an exception) frees its name once
its operation has completed and the rank has synchronized any other handle since submitting it. A rank's own
sequence of calls decides, never the timing of the others.
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
# names taken until synchronized: (id(group), name) -> (group, entry, handle, _SYNCS when submitted); the group
# itself is kept, so that a name taken in a process set since shut down (a new group at the same id) does not
# count. _SYNCS counts this process's synchronizes.
_TAKEN: dict[tuple[int, str], tuple[Any, Entry, int, int]] = {}
_SYNCS = 0
_LOCK = threading.Lock()


class HorovodInternalError(RuntimeError):
    """A collective failed inside hpctrain.horovod (Horovod's exception of the same name)."""


class Handle:
    """The entries of one asynchronous call and how to turn their results into what the call returns."""

    __slots__ = ("entries", "post", "names")

    def __init__(self, entries: list[Entry], post: Callable[[list[Any]], Any]):
        self.entries = entries
        self.post = post
        self.names: list[tuple[int, str]] = []  # the keys of `_TAKEN` it took


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
    with _LOCK:
        for entry in entries:
            taken = _TAKEN.get((id(group), entry.request.name))
            # still taken: not synchronized, and not completed before a later synchronize (given up on)
            if taken is not None and taken[0] is group and not (taken[1].done.is_set() and _SYNCS > taken[3]):
                raise ValueError(f"a {entry.request.kind} named '{entry.request.name}' was submitted on this rank "
                                 f"(handle {taken[2]}) and not synchronized yet: give concurrent operations "
                                 "distinct names")
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
        _HANDLES[handle] = made = Handle(entries, post)
        for entry in entries:
            if entry.request.kind not in ("barrier", "join"):  # named by the library, never twice at once
                made.names.append((id(group), entry.request.name))
                _TAKEN[made.names[-1]] = (group, entry, handle, _SYNCS)
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
    _free_names(found)  # after the wait: a synchronize counts once it has returned
    errors = [entry.error for entry in found.entries if entry.error is not None]
    if errors:
        raise errors[0]
    return found.post([entry.result for entry in found.entries])


def _free_names(synchronized: Handle) -> None:
    """The names `synchronized` took may be submitted again; so may, from now on, those of operations given up
    on (completed, never synchronized): `submit` counts this synchronize."""
    global _SYNCS
    with _LOCK:
        _SYNCS += 1
        for key in synchronized.names:
            taken = _TAKEN.get(key)
            if taken is not None and any(taken[1] is entry for entry in synchronized.entries):
                del _TAKEN[key]


def join_entry(device: int) -> Entry:
    return Entry(Request(name="join", kind="join"))


def barrier_entry(process_set: ProcessSet) -> Entry:
    process_set.barriers += 1
    return Entry(Request(name=f"barrier.{process_set.barriers}", kind="barrier"))


__all__ = ["Adasum", "Average", "Handle", "HorovodInternalError", "Max", "Min", "Product", "Sum",
           "global_process_set", "new_handle", "op_name", "poll", "reduce_op", "request_for", "submit",
           "synchronize"]
