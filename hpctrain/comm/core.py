"""The communication layer: the only module that imports mpi4py.

It owns MPI start-up (lazily, so `import hpctrain` never initializes MPI), the small collectives the
trainer needs (broadcast of the initial state, scalar reductions, gathers) and gradient synchronization
(`GradSync`): gradients live in flat, contiguous buckets, each parameter's `.grad` is a view into its
bucket, and a bucket's allreduce runs on a dedicated communication thread as soon as all of its gradients
are ready, so communication overlaps the rest of backward and no gradient memory is copied.

The communicator is always passed in; `world()` gives COMM_WORLD and works in one process with no launcher.
"""

from __future__ import annotations

import ctypes
import queue
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..base.config import WIRE_FORMATS
from ..base.errors import CommError, ConfigError
from ..base.threads import join_logged

_MPI: Any = None


def _mpi() -> Any:
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


class Comm:
    """A thin wrapper around one mpi4py communicator with the collectives hpctrain uses.

    `Comm(None)` is a world of one that never initializes MPI (tools that run outside any job); every
    collective below returns at once when the size is 1.
    """

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size: int = mpi_comm.Get_size() if mpi_comm is not None else 1

    # -- small collectives -------------------------------------------------------------------------
    def barrier(self) -> None:
        if self.size > 1:
            self.mpi.Barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from `root`."""
        if self.size == 1:
            return obj
        return self.mpi.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        return self.mpi.allgather(obj)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        if self.size == 1:
            return [obj]
        return self.mpi.gather(obj, root=root)

    def allreduce_array(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small float64 vector over all ranks (op: sum, max or min)."""
        buf = np.ascontiguousarray(values, dtype=np.float64).copy()
        if self.size > 1:
            MPI = _mpi()
            self.mpi.Allreduce(MPI.IN_PLACE, buf, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        return buf

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

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (used when one rank cannot go on and the others would hang)."""
        self.mpi.Abort(code)


def world() -> Comm:
    """COMM_WORLD, initializing MPI on first call; a single process with no launcher is a world of one."""
    MPI = _mpi()
    return Comm(MPI.COMM_WORLD)


def self_comm() -> Comm:
    """COMM_SELF: a world of one even under a launcher."""
    return Comm(_mpi().COMM_SELF)


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
    MPI = _mpi()
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
    MPI = _mpi()
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


# ---------------------------------------------------------------------------------------------------
# Gradient synchronization
# ---------------------------------------------------------------------------------------------------



class _Bucket:
    """A flat buffer holding the gradients of a run of parameters, in backward order."""

    __slots__ = ("index", "flat", "params", "ready", "host", "wire", "done")

    def __init__(self, index: int, flat: Any, params: list[Any]):
        self.index = index
        self.flat = flat
        self.params = params
        self.ready: set[int] = set()
        self.host: Any = None  # pinned host staging buffer for device tensors on a non-CUDA-aware MPI
        self.wire: Any = None  # 16-bit wire buffer when compressing
        self.done = threading.Event()


class GradSync:
    """Summing allreduce of a model's gradients over `comm`, in fused zero-copy buckets.

    After `GradSync(params, comm)`, every parameter's `.grad` is a view into a flat bucket; backward
    accumulates into the buckets directly. With `overlap=True`, a post-accumulate-grad hook marks
    parameters ready and a bucket whose gradients are all ready is reduced by the communication thread
    while backward goes on; `wait()` blocks until every bucket is reduced (buckets whose parameters got no
    gradient this step are reduced as they are, zero). Buckets are always reduced in the same order on
    every rank, so ranks that skip a parameter cannot mismatch collectives.

    The caller scales its loss so that the summed gradient is the one it wants (the trainer divides by the
    global sample count of the step), and calls `zero()` instead of `optimizer.zero_grad()`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        comm: Comm,
        *,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        compress: str = "none",
        hierarchical: bool = False,
        deterministic: bool = False,
        node_key: int | None = None,
    ):
        import torch

        if bucket_mb <= 0:
            raise ConfigError(f"--bucket-mb {bucket_mb} must be positive, e.g. 4")
        if compress not in WIRE_FORMATS:
            raise ConfigError(f"unknown gradient wire format --compress {compress!r}: choose one of {', '.join(WIRE_FORMATS)}")
        self.comm = comm
        self.compress = compress
        self.overlap = overlap and comm.size > 1
        self.enabled = True
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
        self.dtype = ordered[0].dtype
        self.device = ordered[0].device
        limit = max(1, int(bucket_mb * 2**20) // ordered[0].element_size())
        groups: list[list[Any]] = [[]]
        size = 0
        for p in ordered:
            if groups[-1] and size + p.numel() > limit:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel()
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for i, group in enumerate(groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=self.dtype, device=self.device)
            offset = 0
            for p in group:
                n = p.numel()
                view = flat[offset : offset + n].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                offset += n
            bucket = _Bucket(i, flat, group)
            for p in group:
                self._bucket_of[id(p)] = bucket
            self.buckets.append(bucket)
        self.deterministic = deterministic and comm.size > 1
        self.notes: list[str] = []
        self._local: Comm | None = None
        self._leaders: Comm | None = None
        if hierarchical and comm.size > 1:
            MPI = _mpi()
            # node_key lets tests emulate several nodes on one host; by default: who shares memory
            local = (comm.mpi.Split(node_key, comm.rank) if node_key is not None
                     else comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank))
            self._local = Comm(local)
            leaders = comm.mpi.Split(0 if self._local.rank == 0 else MPI.UNDEFINED, comm.rank)  # collective
            self._leaders = Comm(leaders) if leaders != MPI.COMM_NULL else None
        self._staging = self.device.type == "cuda" and not self._cuda_aware_confirmed()
        self._queue: queue.Queue[_Bucket | None] = queue.Queue()
        self._error: BaseException | None = None
        self._launched = 0
        self._lock = threading.Lock()
        self._hooks = []
        self._thread: threading.Thread | None = None
        if self.overlap:
            for p in ordered:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            self._thread = threading.Thread(target=self._run, name="hpctrain-comm", daemon=True)
            self._thread.start()
        self.comm_seconds = 0.0
        # Scale each rank's gradient before the sum (e.g. its share of an uneven global batch) and the sum
        # after it (e.g. 1 / world size for a mean); applied in place inside the reduction, no extra pass
        # when both are 1.
        self.prescale = 1.0
        self.postscale = 1.0
        # Or: a callable giving (prescale, postscale), asked once per step when its first gradient is ready.
        self.scale_fn: Callable[[], tuple[float, float]] | None = None
        self._in_round = False

    # -- the public step protocol ------------------------------------------------------------------
    def zero(self) -> None:
        """Zero every bucket (and so every gradient) before the next step; re-attaches lost views.

        Buckets still on the wire (backward ran, step() did not) are awaited first: zeroing memory that is
        being reduced would race the reduction, and skipping their collectives would strand other ranks."""
        if self._in_round and self._launched:
            self.wait()
        self._end_round()
        for bucket in self.buckets:
            bucket.flat.zero_()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if p.grad is None or p.grad.data_ptr() != bucket.flat[offset:].data_ptr():
                    p.grad = bucket.flat[offset : offset + n].view_as(p)
                offset += n

    def wait(self) -> None:
        """Finish the allreduce of every bucket; afterwards each `.grad` holds the sum over ranks."""
        import time

        if not self.enabled:
            return
        start = time.perf_counter()
        if self.comm.size > 1:
            with self._lock:
                self._begin_round()
            if self.overlap:
                with self._lock:
                    while self._launched < len(self.buckets):
                        self._queue.put(self.buckets[self._launched])
                        self._launched += 1
                for bucket in self.buckets:
                    while not bucket.done.wait(1.0):  # the thread always sets it; bounded to notice a dead one
                        if self._thread is None or not self._thread.is_alive():
                            raise CommError("the communication thread is gone; this is a bug, please report it")
            else:
                for bucket in self.buckets:
                    self._reduce_guarded(bucket)
            self._end_round()
            if self._error is not None:
                error, self._error = self._error, None
                raise CommError(f"gradient allreduce failed on rank {self.comm.rank}: {error!r}") from error
        else:
            self._begin_round()
            if self.prescale * self.postscale != 1.0:
                for bucket in self.buckets:
                    bucket.flat.mul_(self.prescale * self.postscale)
            self._end_round()
        self.comm_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Stop the communication thread and remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._thread is not None:
            self._queue.put(None)
            join_logged(self._thread, 30.0, "gradient allreduce")
            self._thread = None

    # -- internals ---------------------------------------------------------------------------------
    def _begin_round(self) -> None:
        """The first gradient of a step is ready (or wait() came first): fix this round's scaling now, when
        the caller knows which batch it is (`scale_fn`), not when it zeroed the gradients."""
        if not self._in_round:
            self._in_round = True
            if self.scale_fn is not None:
                self.prescale, self.postscale = self.scale_fn()

    def _end_round(self) -> None:
        """Every bucket is reduced: the next backward starts a new round of launches."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.done.clear()
        self._launched = 0
        self._in_round = False

    def _on_grad_ready(self, param: Any) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        with self._lock:
            self._begin_round()
            if id(param) in bucket.ready:
                # Its bucket may be on the wire right now: accumulating into it would race the reduction.
                raise CommError(
                    f"a gradient of shape {tuple(param.shape)} became ready twice before its allreduce was awaited: "
                    "a second backward() ran before step() without no_sync(); run all but the last backward of "
                    "an accumulation inside `with optimizer.no_sync():` (hpctrain train: --accumulate K)")
            bucket.ready.add(id(param))
            # Launch strictly in bucket order so every rank issues the same sequence of collectives.
            while self._launched < len(self.buckets):
                nxt = self.buckets[self._launched]
                if len(nxt.ready) < len(nxt.params):
                    break
                self._queue.put(nxt)
                self._launched += 1

    def _run(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        while True:
            bucket = self._queue.get()
            if bucket is None:
                return
            try:
                self._reduce_guarded(bucket)
            finally:
                bucket.done.set()

    def _reduce_guarded(self, bucket: _Bucket) -> None:
        """Reduce `bucket`, keeping the first error for wait() to raise. After an error the remaining
        buckets are still reduced: every other rank enters their collectives, and a rank that skipped them
        would leave the others waiting forever."""
        try:
            self._allreduce(bucket)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() in the caller's thread
            if self._error is None:
                self._error = exc

    def _cuda_aware_confirmed(self) -> bool:
        """The MPI says it is CUDA-aware and one small GPU allreduce at start-up gives the right sum."""
        import torch

        if not cuda_aware():
            self.notes.append("MPI is not CUDA-aware: staging gradients through pinned host buffers")
            return False
        MPI = _mpi()
        probe = torch.ones(4, device=self.device)
        try:
            torch.cuda.synchronize(self.device)
            self.comm.mpi.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM)
            ok = bool((probe == self.comm.size).all())
        except Exception as exc:  # noqa: BLE001 - any failure means: stage through the host
            self.notes.append(f"CUDA-aware allreduce failed at start-up ({exc}): staging through the host")
            return False
        if not ok:
            self.notes.append("CUDA-aware allreduce gave a wrong sum at start-up: staging through the host")
        return ok

    def _allreduce(self, bucket: _Bucket) -> None:
        import torch

        MPI = _mpi()
        flat = bucket.flat
        if self.device.type == "cuda" and self._staging:
            if bucket.host is None:
                bucket.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            bucket.host.copy_(flat, non_blocking=False)
            self._reduce_host(bucket.host, bucket, MPI)
            flat.copy_(bucket.host, non_blocking=False)
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self._reduce_host(flat, bucket, MPI)
        else:
            self._reduce_host(flat, bucket, MPI)

    def _reduce_host(self, flat: Any, bucket: _Bucket, MPI: Any) -> None:
        if self.compress == "none":
            if self.prescale != 1.0:
                flat.mul_(self.prescale)
            self._sum(flat, MPI.SUM, MPI)
            if self.postscale != 1.0:
                flat.mul_(self.postscale)
            return
        import torch

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.compress]
        if bucket.wire is None:
            bucket.wire = torch.empty(flat.shape, dtype=dtype, device=flat.device)
        # Pre-divide by the world size so the 16-bit sum cannot overflow, then scale back in fp32.
        torch.mul(flat, self.prescale / self.comm.size, out=bucket.wire)
        self._sum(bucket.wire, _sum_op(self.compress, MPI), MPI)
        flat.copy_(bucket.wire).mul_(self.comm.size * self.postscale)

    def _sum(self, buf: Any, op: Any, MPI: Any) -> None:
        """In-place sum of `buf` over all ranks: flat, hierarchical or in a fixed order."""
        if self.deterministic:
            self._ordered_sum(buf)
        elif self._local is not None:
            # node-local reduce to the node leader, leaders allreduce, node-local broadcast
            spec = _buffer(buf, MPI)
            if self._local.size > 1:
                self._local.mpi.Reduce(MPI.IN_PLACE if self._local.rank == 0 else spec, spec, op=op, root=0)
            if self._leaders is not None and self._leaders.size > 1:
                self._leaders.mpi.Allreduce(MPI.IN_PLACE, spec, op=op)
            if self._local.size > 1:
                self._local.mpi.Bcast(spec, root=0)
        else:
            self.comm.mpi.Allreduce(MPI.IN_PLACE, _buffer(buf, MPI), op=op)

    def _ordered_sum(self, buf: Any, chunk: int = 1 << 22) -> None:
        """Sum in rank order (((g0 + g1) + g2) + ...), accumulating in float32, whatever MPI's algorithm:
        the same bits in every run and on every rank. Costs an allgather (W x the traffic), in chunks."""
        import torch

        MPI = _mpi()
        flat = buf.view(-1)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            gathered = torch.empty((self.comm.size, part.numel()), dtype=part.dtype, device=part.device)
            self.comm.mpi.Allgather(_buffer(part.contiguous(), MPI), _buffer(gathered, MPI))
            total = gathered[0].float()
            for r in range(1, self.comm.size):
                total += gathered[r].float()
            part.copy_(total)


def _buffer(tensor: Any, MPI: Any) -> Any:
    """An mpi4py buffer spec over a tensor's memory, without a copy."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        raw = tensor.view(torch.int16)
        return [raw if raw.is_cuda else raw.numpy(), _half_type(MPI)]
    if tensor.is_cuda:
        return tensor
    return tensor.numpy()


_HALF: Any = None
_OPS: dict[str, Any] = {}


def _half_type(MPI: Any) -> Any:
    """An MPI datatype for one 16-bit float (fp16 or bf16): two bytes, committed once.

    MPI has no standard 16-bit float type and mpi4py cannot infer one, so the sum is a user op that
    widens each element to float32, adds, and rounds back.
    """
    global _HALF
    if _HALF is None:
        _HALF = MPI.BYTE.Create_contiguous(2).Commit()
    return _HALF


def _sum_op(compress: str, MPI: Any) -> Any:
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

