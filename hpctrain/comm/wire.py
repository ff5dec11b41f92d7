"""The gradient wire formats: mpi4py buffer specs over tensor memory (no copy); the 16-bit formats (fp16, bf16):
their torch dtypes, the MPI datatype of one element, the summing MPI ops that accumulate in float32, and the
one scaled sum every gradient collective runs through (`scaled_sum`: pre-divide by the world size so that a
16-bit sum cannot overflow, sum, scale back in float32).

The MPI module is passed in by the caller, which started it (`world.load_mpi`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def buffer_spec(tensor: Any, MPI: Any, *, resizable: bool = False) -> Any:
    """An mpi4py buffer spec over a tensor's memory, without a copy. `resizable`: hand MPI the memory by its
    address, not through `Tensor.numpy()`, which marks the storage as never to be resized again (ZeRO 3 frees
    and reallocates its gathered parameters' storage every step).

    Every tensor the comm layer hands to MPI passes through here (tests/unit/test_wire.py checks that), so this is
    where a CUDA tensor's stream is synchronized: the kernels queued on it so far (the gradients, a cast to the
    wire format, a prescale, a `torch.cat`, PowerSGD's matmuls, top-k's values and indices) have all finished
    before MPI reads the memory, whatever its transport's ordering against torch's stream.
    """
    import torch

    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        raw = tensor.view(torch.int16)
        return [raw if raw.is_cuda else _host_array(raw, MPI, resizable), half_type(MPI)]
    if tensor.is_cuda:
        return tensor
    return _host_array(tensor, MPI, resizable)


def _host_array(tensor: Any, MPI: Any, resizable: bool) -> Any:
    """A numpy array over a host tensor's memory: by its address when `resizable` (the storage stays free to
    be resized: ZeRO 3's gathered parameters and gradient slices, in any dtype), else `Tensor.numpy()`, which
    keeps the tensor alive as long as the array."""
    if resizable and tensor.numel():
        nbytes = tensor.numel() * tensor.element_size()
        return np.frombuffer(MPI.buffer.fromaddress(tensor.data_ptr(), nbytes),
                             dtype=str(tensor.dtype).removeprefix("torch."))
    return tensor.numpy()


DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""The torch dtype (by name) of each precision and wire format hpctrain names: the one map of them."""


def torch_dtype(name: str) -> Any:
    """The torch dtype of `name`: fp32, fp16 or bf16."""
    import torch

    return getattr(torch, DTYPES[name])


def wire_bytes(numel: int, element_size: int, kind: str) -> int:
    """The bytes `numel` elements take on the wire: their own size, or 2 in a 16-bit format."""
    return numel * (element_size if kind == "none" else 2)


def scaled_sum(send: Any, out: Any, kind: str, prescale: float, postscale: float, world: int,
               collective: Callable[[Any, Any, Any], None], MPI: Any, wire: Any = None) -> None:
    """`out` = postscale x (the sum over the ranks of prescale x `send`), by `collective(send, recv, op)` (an
    allreduce in place when `out` is `send`, else a reduce-scatter of `send` into `out`). In `kind` fp16 or bf16
    the values travel in 16 bits, pre-divided by the world size so that the sum cannot overflow and scaled
    back in float32; `wire` is a reusable 16-bit buffer shaped like `send` (allocated here when None). `send`
    may be scaled in place."""
    import torch

    if kind == "none":
        if prescale != 1.0:
            send.mul_(prescale)
        collective(send, out, MPI.SUM)
        if postscale != 1.0:
            out.mul_(postscale)
        return
    dtype = torch_dtype(kind)
    wire = torch.mul(send, prescale / world, out=wire if wire is not None else torch.empty(
        send.shape, dtype=dtype, device=send.device))
    wire_out = wire if out is send else torch.empty(out.shape, dtype=dtype, device=out.device)
    collective(wire, wire_out, sum_op(kind, MPI))
    out.copy_(wire_out).mul_(world * postscale)


_HALF: Any = None
_OPS: dict[str, Any] = {}


def half_type(MPI: Any) -> Any:
    """An MPI datatype for one 16-bit float (fp16 or bf16): two bytes, committed once.

    MPI has no standard 16-bit float type and mpi4py cannot infer one, so the sum is a user op that
    widens each element to float32, adds, and rounds back.
    """
    global _HALF
    if _HALF is None:
        _HALF = MPI.BYTE.Create_contiguous(2).Commit()
    return _HALF


def sum_op(compress: str, MPI: Any) -> Any:
    """A summing op for 16-bit floats, accumulating each element pair in float32."""
    if compress in _OPS:
        return _OPS[compress]

    if compress == "fp16":

        def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=np.float16)
            b = np.frombuffer(inoutbuf, dtype=np.float16)
            b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)

    else:

        def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=np.uint16).astype(np.uint32) << 16
            b_raw = np.frombuffer(inoutbuf, dtype=np.uint16)
            b = b_raw.astype(np.uint32) << 16
            total = a.view(np.float32) + b.view(np.float32)
            bits = total.view(np.uint32)
            # round to nearest even, as torch does when casting float32 to bfloat16
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            b_raw[...] = (bits >> 16).astype(np.uint16)

    _OPS[compress] = MPI.Op.Create(add, commute=True)
    return _OPS[compress]
