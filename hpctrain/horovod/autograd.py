"""The blocking, differentiable collectives (`hvd.allreduce`, `hvd.allgather`, ...): torch autograd Functions
whose backward is the adjoint collective, as in Horovod:

- allreduce: the same allreduce of the gradient;
- allgather: the average of the gradient over the set, this rank's rows of it;
- broadcast: the average of the gradient on the root, zero elsewhere;
- alltoall: an alltoall of the gradient with the received splits;
- reducescatter: an allgather of the gradient (times the set's size for Sum, and the scale factors).
"""

from __future__ import annotations

from typing import Any

import torch

from .basics import ProcessSet, global_process_set, rank
from .compression import Compression
from .handles import Average, Sum, synchronize
from . import mpi_ops as ops


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, name: Any, op: int, pre: float, post: float, process_set: ProcessSet) -> Any:
        ctx.args = (op, pre, post, process_set)
        return synchronize(ops.allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        op, pre, post, process_set = ctx.args
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=process_set), \
            None, None, None, None, None


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """The reduction (default: average) of `tensor` over the process set, as a new tensor."""
    op = ops.average_compat(op, average)
    compressed, state = compression.compress(tensor)
    summed = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(summed, state)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: int, pre: float, post: float, process_set: ProcessSet, *tensors: Any) -> Any:
        ctx.args = (op, pre, post, process_set)
        return tuple(synchronize(ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        op, pre, post, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post,
                                    process_set=process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: list[Any], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[Any]:
    op = ops.average_compat(op, average)
    pairs = [compression.compress(t) for t in tensors]
    summed = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in pairs])
    return [compression.decompress(s, p[1]) for s, p in zip(summed, pairs)]


def _own_rows(grad: Any, rows: int, process_set: ProcessSet) -> Any:
    everyone = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set).tolist()
    me = process_set.rank()
    return grad.narrow(0, sum(everyone[:me]), rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, name: Any, process_set: ProcessSet) -> Any:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return _own_rows(reduced, ctx.rows, ctx.process_set), None, None


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """The tensors of every member concatenated along the first dimension (which may differ per rank)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, process_set: ProcessSet, *tensors: Any) -> Any:
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(ops.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        return (None, None, *[_own_rows(g, rows, ctx.process_set) for g, rows in zip(reduced, ctx.rows)])


def grouped_allgather(tensors: list[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, root_rank: int, name: Any, process_set: ProcessSet) -> Any:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s tensor (a global rank), as a new tensor on every member."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, splits: Any, name: Any, process_set: ProcessSet) -> Any:
        output, received = synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: Any, *unused: Any) -> Any:
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows of `tensor` to the members (`splits[i]` to member i, equal parts without splits) and gather
    theirs; returns the gathered tensor, and with `splits` also the received splits."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, name: Any, op: int, process_set: ProcessSet, pre: float, post: float) -> Any:
        ctx.args = (op, process_set, pre, post)
        return synchronize(ops.reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        op, process_set, pre, post = ctx.args
        return allgather(grad * _reducescatter_gain(op, process_set, pre, post), process_set=process_set), \
            None, None, None, None, None


def _reducescatter_gain(op: int, process_set: ProcessSet, pre: float, post: float) -> float:
    return (process_set.size() if op == Sum else 1) * pre * post


def reducescatter(tensor: Any, name: str | None = None, compression: Any = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """The reduction over the set, split along the first dimension: this rank's part (the first ranks get one
    row more when it does not divide evenly)."""
    compressed, state = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, state)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: int, process_set: ProcessSet, pre: float, post: float, *tensors: Any) -> Any:
        ctx.args = (op, process_set, pre, post)
        return tuple(synchronize(ops.grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        op, process_set, pre, post = ctx.args
        gain = _reducescatter_gain(op, process_set, pre, post)
        return (None, None, None, None, None, *grouped_allgather([g * gain for g in grads], process_set=process_set))


def grouped_reducescatter(tensors: list[Any], name: str | None = None, compression: Any = Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[p[0] for p in pairs])
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs)]
