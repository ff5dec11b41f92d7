"""MPI start-up and the communicator: the collectives hpctrain uses, and what the MPI in use can do.

It owns MPI start-up (lazily, so `import hpctrain` never initializes MPI), `Comm` with the small collectives
the trainer needs (broadcast of the initial state, scalar reductions, gathers, the raw allreduce that
`bench` measures against), `world()`/`self_comm()`, and the description of the MPI library (`mpi_info`,
including whether it is CUDA-aware).

The communicator is always passed in; `world()` gives COMM_WORLD and works in one process with no launcher.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..base.errors import CommError
from ..trace.flight import RECORDER

_MPI: Any = None


def load_mpi() -> Any:
    """Import mpi4py on first use, asking for MPI_THREAD_MULTIPLE (the comm thread calls MPI)."""
    global _MPI
    if _MPI is None:
        try:
            import mpi4py

            mpi4py.rc.thread_level = "multiple"
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise CommError(
                f"cannot import mpi4py ({exc}); install an MPI library (apt-get install openmpi-bin "
                "libopenmpi-dev) and then `pip install 'mpi4py>=4'`"
            ) from exc
        _MPI = MPI
    return _MPI


def recorded(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A collective of `Comm` as the flight recorder sees it: one record per call (none in a world of one)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(self: "Comm", *args: Any, **kwargs: Any) -> Any:
            if self.size == 1:
                return fn(self, *args, **kwargs)
            seq = RECORDER.begin(op, group=self.flight)
            try:
                return fn(self, *args, **kwargs)
            finally:
                RECORDER.end(seq)

        return call

    return wrap


class Comm:
    """A thin wrapper around one mpi4py communicator with the collectives hpctrain uses.

    `Comm(None)` is a world of one that never initializes MPI (tools that run outside any job); every
    collective below returns at once when the size is 1.

    `name` and `ranks` are what the flight recorder knows it by: a communicator made from MPI's own is the
    "world" of the ranks it numbers; one split from it (`split`) lists its members as ranks of that world, so
    the records of a data-parallel or tensor-parallel group name the ranks of the run. `flight` is its id in
    the recorder, registered once here (0, the default group, for a world of one, which records nothing).
    """

    def __init__(self, mpi_comm: Any, name: str = "world", ranks: tuple[int, ...] | None = None):
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size: int = mpi_comm.Get_size() if mpi_comm is not None else 1
        self.name = name
        self.ranks: tuple[int, ...] = tuple(range(self.size)) if ranks is None else tuple(ranks)
        self.flight = RECORDER.group(name, self.ranks) if self.size > 1 else 0

    # -- small collectives -------------------------------------------------------------------------
    @recorded("barrier")
    def barrier(self) -> None:
        if self.size > 1:
            self.mpi.Barrier()

    @recorded("bcast")
    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from `root`."""
        if self.size == 1:
            return obj
        return self.mpi.bcast(obj, root=root)

    @recorded("allgather")
    def allgather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        return self.mpi.allgather(obj)

    @recorded("gather")
    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        if self.size == 1:
            return [obj]
        return self.mpi.gather(obj, root=root)

    @recorded("allreduce")
    def allreduce_array(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small float64 vector over all ranks (op: sum, max or min)."""
        buf = np.ascontiguousarray(values, dtype=np.float64).copy()
        if self.size > 1:
            MPI = load_mpi()
            self.mpi.Allreduce(MPI.IN_PLACE, buf, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        return buf

    @recorded("bcast")
    def broadcast_tensors(self, tensors: Iterable[Any], root: int = 0) -> None:
        """Broadcast CPU tensors in place from `root` (parameters and buffers at start-up)."""
        import torch

        if self.size == 1:
            return
        for tensor in tensors:
            if not tensor.numel():
                continue
            direct = not tensor.is_cuda and tensor.is_contiguous()
            host = tensor.detach() if direct else tensor.detach().cpu().contiguous()
            # raw bytes: any dtype, bfloat16 and bool included (numpy has no bfloat16)
            self.mpi.Bcast(host.reshape(-1).view(torch.uint8).numpy(), root=root)
            if not direct:
                tensor.data.copy_(host)

    def agree(self, error: Exception | None) -> None:
        """Raise on every rank when any rank failed (its checks, its part of the work), so that no rank walks
        into the next collective alone. The failing rank re-raises its own error; the others raise one
        that names it, with the same exit code."""
        from ..base.errors import HpctrainError

        mine = None if error is None else (str(error), getattr(error, "exit_code", 1))
        messages = self.allgather(mine)
        bad = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not bad:
            return
        if error is not None:
            error.agreed = True  # every rank raises now: nobody is left waiting, no abort needed
            raise error
        rank, (text, code) = bad[0]
        exc = HpctrainError(f"rank {rank}: {text}")
        exc.exit_code = code
        exc.agreed = True
        raise exc

    def split(self, color: int | None, key: int, name: str = "group") -> "Comm | None":
        """The ranks of this communicator that pass the same `color`, ordered by `key` (MPI_Comm_split; a
        collective of every rank); None for a rank that passes None (it joins no group). A world of one
        splits into itself. `name`: what the flight recorder and its line-up call the new communicator."""
        if self.mpi is None:
            return None if color is None else self
        MPI = load_mpi()
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        mine, parent = sub.Get_group(), self.mpi.Get_group()
        try:
            inside = MPI.Group.Translate_ranks(mine, list(range(sub.Get_size())), parent)
        finally:
            mine.Free()
            parent.Free()
        return Comm(sub, name, tuple(self.ranks[r] for r in inside))

    def as_world(self) -> "Comm":
        """This communicator as the world of a run (the ranks its flight records name are its own, 0..size-1):
        itself, or, for one split from another, a new handle of the same MPI communicator."""
        if self.name == "world" and self.ranks == tuple(range(self.size)):
            return self
        return Comm(self.mpi)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (used when one rank cannot go on and the others would hang)."""
        self.mpi.Abort(code)


    # -- raw MPI, for measurements ---------------------------------------------------------------
    def allreduce_inplace(self, buf: np.ndarray) -> None:
        """Sum a contiguous numpy array over all ranks in place with one MPI Allreduce: no copy, no
        conversion and no shortcut at size 1 (the raw baseline `bench` times hpctrain's sync against)."""
        if self.mpi is None:
            return
        MPI = load_mpi()
        self.mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    @recorded("barrier")
    def idle_barrier(self, poll_s: float | None = 0.005) -> None:
        """A barrier whose waiting ranks sleep `poll_s` between polls instead of spinning a core (a blocking
        MPI barrier busy-polls and would steal CPU from a rank still at work); `poll_s=None` waits inside
        MPI (for the rank the others wait for). Every rank must call this one, not `barrier()`: MPI never
        matches a nonblocking barrier with a blocking one."""
        if self.size == 1:
            return
        req = self.mpi.Ibarrier()
        if poll_s is None:
            req.Wait()
            return
        while not req.Test():
            time.sleep(poll_s)

_WORLD: Comm | None = None


def world() -> Comm:
    """COMM_WORLD, initializing MPI on first call; a single process with no launcher is a world of one. One
    handle for the process: the flight recorder numbers the collectives of COMM_WORLD once, whoever calls them."""
    global _WORLD
    if _WORLD is None:
        _WORLD = Comm(load_mpi().COMM_WORLD)
    return _WORLD


def self_comm() -> Comm:
    """COMM_SELF: a world of one even under a launcher."""
    return Comm(load_mpi().COMM_SELF)


@dataclass(frozen=True, slots=True)
class MpiInfo:
    """What `doctor` and the start-up log say about the MPI in use."""

    library: str
    mpi_version: str
    mpi4py_version: str
    thread_level: str
    cuda_aware: bool | None


def mpi_info() -> MpiInfo:
    """Describe the MPI library, the thread level it provides and whether it is CUDA-aware."""
    MPI = load_mpi()
    import mpi4py

    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    major, minor = MPI.Get_version()
    return MpiInfo(
        library=MPI.Get_library_version().strip().splitlines()[0].rstrip(","),
        mpi_version=f"{major}.{minor}",
        mpi4py_version=mpi4py.__version__,
        thread_level=levels.get(MPI.Query_thread(), "unknown"),
        cuda_aware=cuda_aware(),
    )


def cuda_aware() -> bool | None:
    """Whether the MPI library can take CUDA device pointers (None when it cannot tell).

    Asks, in order: Open MPI's `MPIX_Query_cuda_support()` extension, the MPI-4.1 info key
    `mpi_memory_alloc_kinds` on COMM_WORLD, and `ompi_info`'s `mpi_built_with_cuda_support`.
    """
    MPI = load_mpi()
    try:
        fn = ctypes.CDLL(None).MPIX_Query_cuda_support
        fn.restype = ctypes.c_int
        return bool(fn())
    except (AttributeError, OSError):
        pass
    try:
        info = MPI.COMM_WORLD.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds")
        info.Free()
        if kinds is not None:
            return "cuda" in kinds
    except Exception:  # noqa: BLE001 - an MPI without MPI-4.1 info keys
        pass
    ompi_info = shutil.which("ompi_info")
    if ompi_info:
        out = subprocess.run(
            [ompi_info, "--parsable", "--all"], capture_output=True, text=True, check=False
        ).stdout
        for line in out.splitlines():
            if "mpi_built_with_cuda_support:value" in line:
                return line.rsplit(":", 1)[-1].strip() == "true"
    return None
