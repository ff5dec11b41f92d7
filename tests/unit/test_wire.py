"""The hand-off of tensor memory to MPI: one place, `wire.buffer_spec`, which orders it after the GPU's kernels.

A CUDA transport is not ordered against torch's stream: memory handed to MPI while kernels that write it are
still queued (a cast to the 16-bit wire format, a prescale, `torch.cat` of PowerSGD's rest, top-k's values and
indices) can be read early. The stream used to be synchronized once per bucket, before those kernels were
queued. No GPU is here: the CUDA tensor and its stream are stand-ins, and the second test checks by reading
the code that every tensor the comm layer gives MPI goes through `buffer_spec`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

from hpctrain.comm import wire

COMM = Path(wire.__file__).parent
# MPI calls that take buffers, and the arguments that may stand there without buffer_spec
BUFFER_CALLS = {"Allreduce", "Reduce", "Bcast", "Allgather", "Allgatherv", "Reduce_scatter", "Reduce_scatter_block",
                "Alltoall", "Alltoallv", "Send", "Recv", "Isend", "Irecv", "Sendrecv", "Gather", "Scatter"}
SPEC_MAKERS = {"buffer_spec", "vspec"}
# host-only call sites: small numpy vectors and bytes that never live on a GPU (world.Comm's helpers, the clock
# exchange's one float64)
HOST_ONLY = {("world.py", "allreduce_array"), ("world.py", "broadcast_tensors"), ("world.py", "allreduce_inplace"),
             ("clocks.py", "_lead"), ("clocks.py", "_follow")}


class _FakeCudaTensor:
    """Just enough of a CUDA tensor for buffer_spec: where it lives and its dtype."""

    is_cuda = True
    dtype = torch.float32
    device = "cuda:0"


def test_a_cuda_tensor_handed_to_mpi_waits_for_its_stream(monkeypatch) -> None:
    calls: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    tensor = _FakeCudaTensor()
    assert wire.buffer_spec(tensor, None) is tensor
    assert calls == ["synchronize"]
    calls.clear()
    assert isinstance(wire.buffer_spec(torch.ones(3), None), np.ndarray) and calls == []  # host memory: nothing


def test_a_resizable_spec_leaves_the_storage_resizable_in_every_dtype() -> None:
    """ZeRO 3 frees its gathered parameters and gradient slices (storage resized to nothing) between uses; the
    spec MPI writes them through must not pin their size, in 16 bits (bf16 parameters) as in 32."""
    from mpi4py import MPI

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = torch.arange(6, dtype=torch.float32).to(dtype)
        spec = wire.buffer_spec(tensor, MPI, resizable=True)
        array = spec[0] if isinstance(spec, list) else spec
        assert array.ctypes.data == tensor.data_ptr() and array.nbytes == tensor.numel() * tensor.element_size()
        tensor.untyped_storage().resize_(0)  # raises once Tensor.numpy() has pinned the storage
        tensor.untyped_storage().resize_(6 * tensor.element_size())


def _spec_names(func: ast.FunctionDef) -> set[str]:
    """Names bound in `func` to a buffer spec (spec = buffer_spec(...))."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _called(node.value) in SPEC_MAKERS:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_spec(arg: ast.expr, names: set[str]) -> bool:
    if isinstance(arg, ast.Attribute) and arg.attr == "IN_PLACE":
        return True
    if isinstance(arg, ast.IfExp):
        return _is_spec(arg.body, names) and _is_spec(arg.orelse, names)
    if isinstance(arg, ast.Name):
        return arg.id in names
    return isinstance(arg, ast.Call) and _called(arg) in SPEC_MAKERS


def test_every_tensor_the_comm_layer_gives_mpi_goes_through_buffer_spec() -> None:
    unchecked = []
    for path in sorted(COMM.glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef) or (path.name, func.name) in HOST_ONLY:
                continue
            names = _spec_names(func)
            for call in ast.walk(func):
                if isinstance(call, ast.Call) and _called(call) in BUFFER_CALLS:
                    bad = [ast.unparse(a) for a in call.args if not _is_spec(a, names)]
                    if bad:
                        unchecked.append(f"{path.name}:{call.lineno} {func.name}: {ast.unparse(call)[:90]}")
    assert unchecked == [], "hand these to MPI through wire.buffer_spec:\n" + "\n".join(unchecked)
