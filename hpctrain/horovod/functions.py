"""Broadcasting a model's and an optimizer's state, and picklable objects (Horovod's `functions.py`)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from .autograd import allgather
from .basics import ProcessSet, global_process_set, rank
from .mpi_ops import broadcast_, broadcast_async_, synchronize


def broadcast_parameters(params: Any, root_rank: int, prefix: str | None = None) -> None:
    """Copy `root_rank`'s tensors to every rank, in place: a `state_dict()`, `named_parameters()` or a list of
    tensors or (name, tensor) pairs."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for name, tensor in items:
        name = f"{prefix}.{name}" if prefix and name else name
        handles.append(broadcast_async_(tensor, root_rank, name))
    for handle in handles:
        synchronize(handle)


def _pickle(obj: Any) -> bytes:
    try:
        import cloudpickle

        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s object on every member (pickled; torch tensors inside travel with it)."""
    name = name or type(obj).__name__
    if rank() == root_rank:
        data = torch.frombuffer(bytearray(_pickle(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        broadcast_(length, root_rank, f"{name}.sz", process_set)
    else:
        length = torch.zeros(1, dtype=torch.int64)
        broadcast_(length, root_rank, f"{name}.sz", process_set)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name}.t", process_set)
    if rank() == root_rank:
        return obj
    return pickle.loads(data.numpy().tobytes())  # from a rank of this job, as Horovod's (cloud)pickle


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's object, in member order."""
    name = name or type(obj).__name__
    data = torch.frombuffer(bytearray(_pickle(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz",
                      process_set=process_set).tolist()
    gathered = allgather(data, name=f"{name}.t", process_set=process_set).numpy().tobytes()
    out, offset = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[offset:offset + n]))
        offset += n
    return out


def _skeleton(value: Any, tensors: list[Any]) -> Any:
    """`value` with each tensor replaced by its index in `tensors` (as a marker)."""
    if torch.is_tensor(value):
        tensors.append(value)
        return ("__hvd_tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    return value


def _is_marker(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 5 and value[0] == "__hvd_tensor__"


def _fill(value: Any, tensors: list[Any]) -> Any:
    if _is_marker(value):
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _markers(value: Any) -> list[tuple[Any, ...]]:
    if _is_marker(value):
        return [value]
    if isinstance(value, dict):
        return [m for v in value.values() for m in _markers(v)]
    if isinstance(value, (list, tuple)):
        return [m for v in value for m in _markers(v)]
    return []


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Give every rank `root_rank`'s optimizer state and hyper-parameters, in place.

    The state's structure travels as one object and its tensors as broadcasts, so a rank that has no state
    yet (no step taken) gets it without an optimizer step, which would move its parameters (weight decay)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    for group in optimizer.param_groups:  # as Horovod leaves them: every trainable parameter has a gradient
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    tensors: list[Any] = []
    skeleton = _skeleton(optimizer.state_dict(), tensors) if rank() == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.skeleton")
    if rank() != root_rank:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                               device="cuda" if device == "cuda" else "cpu")
                   for _, _, shape, dtype, device in _markers(skeleton)]
    handles = [broadcast_async_(t, root_rank, f"broadcast_optimizer_state.{i}") for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    if rank() != root_rank:
        optimizer.load_state_dict(_fill(skeleton, tensors))
