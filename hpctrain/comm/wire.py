"""The gradient wire formats: mpi4py buffer specs over tensor memory (no copy), and for the 16-bit formats
(fp16, bf16) the MPI datatype of one element and the summing MPI ops that accumulate in float32.

The MPI module is passed in by the caller, which started it (`world.load_mpi`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def buffer_spec(tensor: Any, MPI: Any) -> Any:
    """An mpi4py buffer spec over a tensor's memory, without a copy.

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
        return [raw if raw.is_cuda else raw.numpy(), half_type(MPI)]
    if tensor.is_cuda:
        return tensor
    return tensor.numpy()


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
