"""The buckets of a gradient sync: which parameters share one collective, and the memory it runs on.

Autograd owns the gradients (`GradSync.zero()` drops them, as torch's `zero_grad()` does): a gradient of at
least `GradSync.OWN_BYTES` is a bucket alone, reduced in the memory autograd handed over; a run of small ones
is packed into one flat buffer allocated once, and their `.grad`s become its views (`bind_bucket`).
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from ..base.errors import ConfigError


def trainable_in_backward_order(params: Iterable[Any]) -> list[Any]:
    """The distinct trainable parameters, last layers first; they must share one dtype and one device."""
    unique: dict[int, Any] = {}
    for p in params:
        if p.requires_grad and id(p) not in unique:
            unique[id(p)] = p
    ordered = list(unique.values())[::-1]  # backward visits the last layers first
    if not ordered:
        raise ConfigError("the model has no trainable parameters")
    dtypes = {p.dtype for p in ordered}
    devices = {p.device for p in ordered}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ConfigError(
            f"all trainable parameters must share one dtype and device (found {sorted(map(str, dtypes))} "
            f"on {sorted(map(str, devices))}); cast the model with .to() first"
        )
    return ordered


def assign_buckets(ordered: list[Any], bucket_mb: float, alone_bytes: int | None = None,
                   alone: Iterable[Any] = ()) -> list[list[Any]]:
    """Cut the parameters, in order, into runs of at most `bucket_mb` MiB; a larger parameter is a run alone,
    and so is one of at least `alone_bytes` (when given), and each of `alone`."""
    size_of = ordered[0].element_size()
    limit = max(1, int(bucket_mb * 2**20) // size_of)
    limit_alone = limit if alone_bytes is None else min(limit, max(1, alone_bytes // size_of))
    single = {id(p) for p in alone}
    groups: list[list[Any]] = [[]]
    size, last_alone = 0, False
    for p in ordered:
        is_alone = p.numel() >= limit_alone or id(p) in single
        if groups[-1] and (size + p.numel() > limit or is_alone or last_alone):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel()
        last_alone = is_alone
    return groups


class Bucket:
    """A flat buffer holding the gradients of a run of parameters, in backward order."""

    __slots__ = ("index", "flat", "params", "ready", "host", "wire", "done", "views", "own")

    def __init__(self, index: int, flat: Any, params: list[Any]):
        self.index = index
        self.flat = flat
        self.params = params
        self.views: list[Any] = []  # a packed bucket's slices, one per parameter (owned gradients)
        self.own = False  # one parameter reduced from its own gradient's memory: `flat` is bound per step
        self.ready: set[int] = set()
        self.host: Any = None  # pinned host staging buffer for device tensors on a non-CUDA-aware MPI
        self.wire: Any = None  # 16-bit wire buffer when compressing
        self.done = threading.Event()


def owned_bucket(index: int, group: list[Any], dtype: Any, device: Any) -> Bucket:
    """A bucket over gradients autograd owns: one parameter is reduced from its own `.grad` (bound each step),
    several are packed into a flat buffer allocated here once (their `.grad`s become its views when packed)."""
    import torch

    if len(group) == 1:
        bucket = Bucket(index, None, group)
        bucket.own = True
        return bucket
    bucket = Bucket(index, torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device), group)
    offset = 0
    for p in group:
        bucket.views.append(bucket.flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return bucket


def bind_bucket(bucket: Bucket) -> None:
    """Point an owned bucket at this step's gradients: its parameter's own `.grad` (zeros when backward gave it
    none, made contiguous if it is not), or the small gradients copied into the flat buffer (zeros for one that
    got none), each `.grad` then a view into it. Idempotent within a step."""
    import torch

    if bucket.own:
        p = bucket.params[0]
        if p.grad is None:
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        bucket.flat = p.grad.view(-1)
        return
    for p, view in zip(bucket.params, bucket.views):
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            continue
        p.grad = view
