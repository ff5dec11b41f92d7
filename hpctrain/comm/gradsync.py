"""Gradient synchronization: `GradSync`, a summing allreduce of a model's gradients in buckets.

Autograd owns the gradients, as in a plain torch step: `zero()` drops them (`.grad = None`), so backward
neither zeroes nor accumulates into old memory, it hands over fresh tensors. A large gradient (at least
`OWN_BYTES`) is a bucket alone and is reduced straight from its own memory; runs of small ones share a flat
buffer they are copied into (their `.grad`s then become views into it), so one collective carries them.
Measured on the reference MLP: the zeroing pass and the accumulation into persistent bucket views cost
more than the small copies do (`hpctrain bench train`, docs/performance.md, "The step against the honest limit").
A bucket's allreduce runs on a dedicated communication thread as soon as all of its gradients are ready
(with overlap), or in `wait()`. The sum is flat, hierarchical (node, then node leaders) or in a fixed rank
order (deterministic).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable

from ..base.config import parse_grad_compression
from ..base.errors import CommError, ConfigError
from ..base.hostmem import reuse_freed_memory
from ..base.threads import join_logged
from ..trace.flight import RECORDER
from . import compress as compression
from .buckets import Bucket, assign_buckets, bind_bucket, owned_bucket, trainable_in_backward_order
from .wire import buffer_spec, sum_op
from .world import Comm, cuda_aware, load_mpi


def _node_groups(comm: Comm, node_key: int | None) -> tuple[Comm, Comm | None]:
    """The communicators of a hierarchical sum: this node's ranks, and the node leaders (None off them)."""
    MPI = load_mpi()
    # node_key lets tests emulate several nodes on one host; by default: who shares memory
    local = (comm.mpi.Split(node_key, comm.rank) if node_key is not None
             else comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank))
    local_comm = Comm(local)
    leaders = comm.mpi.Split(0 if local_comm.rank == 0 else MPI.UNDEFINED, comm.rank)  # collective
    return local_comm, (Comm(leaders) if leaders != MPI.COMM_NULL else None)


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

    EAGER = False  # reduce each bucket inline as soon as it is full even without overlap (see __init__)
    COLLECTIVE = "allreduce"  # what the flight recorder calls a bucket's sum
    OWN_BYTES = 1 << 18  # a gradient this large is a bucket alone, reduced from its own memory

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
        alone: Iterable[Any] = (),
    ):
        if bucket_mb <= 0:
            raise ConfigError(f"--bucket-mb {bucket_mb} must be positive, e.g. 4")
        kind, _ = parse_grad_compression(compress)
        reuse_freed_memory()  # zero() drops the gradients every step: their memory is kept for the next
        self.comm = comm
        self.compress = kind  # none, fp16 or bf16 on the wire; powersgd and topk: `compressor`
        self.compressor = compression.make(compress, comm)
        self.wire_bytes = 0  # what this rank put on the wire in the last step (its payload)
        self._wire_round = 0
        self.overlap = overlap and comm.size > 1
        # eager: without overlap, still reduce each bucket as soon as backward has filled it, inline in the
        # backward (a subclass that frees gradient memory per bucket wants this; the allreduce does not)
        self.eager = self.EAGER and comm.size > 1
        self.enabled = True
        ordered = trainable_in_backward_order(params)
        self.dtype = ordered[0].dtype
        self.device = ordered[0].device
        self.buckets: list[Bucket] = [self._make_bucket(i, group)
                                       for i, group in enumerate(assign_buckets(ordered, bucket_mb, self.OWN_BYTES, alone))]
        self._bucket_of: dict[int, Bucket] = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.deterministic = deterministic and comm.size > 1
        self.notes: list[str] = []
        self._local: Comm | None = None
        self._leaders: Comm | None = None
        if hierarchical and comm.size > 1:
            self._local, self._leaders = _node_groups(comm, node_key)
        self._staging = self._needs_staging()
        self._queue: queue.Queue[Bucket | None] = queue.Queue()
        self._error: BaseException | None = None
        self._launched = 0
        self._lock = threading.Lock()
        self._hooks = []
        self._thread: threading.Thread | None = None
        if self.overlap or self.eager:
            self._start_overlap(ordered)
        self.comm_seconds = 0.0
        self.hook_seconds = 0.0  # time spent in the gradient-ready hooks (inside backward), summed
        # Scale each rank's gradient before the sum (e.g. its share of an uneven global batch) and the sum
        # after it (e.g. 1 / world size for a mean); applied in place inside the reduction, no extra pass
        # when both are 1.
        self.prescale = 1.0
        self.postscale = 1.0
        # Or: a callable giving (prescale, postscale), asked once per step when its first gradient is ready.
        self.scale_fn: Callable[[], tuple[float, float]] | None = None
        # The loss scale the gradients carry (fp16), set before each backward; None: no loss scaling. Only the
        # compressors need it: their error feedback must not store scaled, possibly overflowed, gradients.
        self.loss_scale: float | None = None
        self._in_round = False

    @property
    def staging(self) -> bool:
        """Whether device gradients are staged through pinned host buffers (the MPI is not CUDA-aware, or its
        start-up probe failed)."""
        return self._staging

    # -- the public step protocol ------------------------------------------------------------------
    def zero(self) -> None:
        """Before the next step: drop every gradient (`.grad = None`, as torch's `zero_grad()` does); the next
        backward hands over fresh ones.

        Buckets still on the wire (backward ran, step() did not) are awaited first: touching memory that is
        being reduced would race the reduction, and skipping their collectives would strand other ranks."""
        if self._in_round and self._launched:
            self.wait()
        self._end_round()
        for bucket in self.buckets:
            if bucket.own:
                bucket.flat = None  # the gradient's memory goes with it
            for p in bucket.params:
                p.grad = None

    def wait(self) -> None:
        """Finish the allreduce of every bucket; afterwards each `.grad` holds the sum over ranks."""
        if not self.enabled:
            return
        start = time.perf_counter()
        if self.comm.size > 1:
            with self._lock:
                self._begin_round()
            if self.overlap:
                with self._lock:
                    while self._launched < len(self.buckets):
                        RECORDER.handoff(self.buckets[self._launched].index)
                        self._queue.put(self.buckets[self._launched])
                        self._launched += 1
                for bucket in self.buckets:
                    while not bucket.done.wait(1.0):  # the thread always sets it; bounded to notice a dead one
                        if self._thread is None or not self._thread.is_alive():
                            raise CommError("the communication thread is gone; this is a bug, please report it")
            else:
                while self._launched < len(self.buckets):  # those the backward did not reduce eagerly
                    self._launched += 1
                    self._reduce_guarded(self.buckets[self._launched - 1])
            self._end_round()
            self.wire_bytes = self._wire_round
            if self._error is not None:
                error, self._error = self._error, None
                raise CommError(f"gradient allreduce failed on rank {self.comm.rank}: {error!r}") from error
        else:
            self._begin_round()
            self._local_round()
            self._end_round()
        self.comm_seconds = time.perf_counter() - start

    def compressor_state(self) -> dict[str, Any] | None:
        """The compressor's per-rank state (error feedback, warm starts) for a checkpoint; None without one."""
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_compressor_state(self, state: dict[str, Any]) -> str | None:
        """Restore `compressor_state()`; its tensors move to the memory the compressor works on (a checkpoint
        loads on the CPU): the gradients' device, or the host when device gradients are staged through it.
        State saved for another bucket layout is not loaded; the returned line says so (None: loaded)."""
        if self.compressor is None:
            return None
        sizes = {b.index: sum(p.numel() for p in b.params) for b in self.buckets}
        wrong = {int(k): v.numel() for k, v in state.get("errors", {}).items() if sizes.get(int(k)) != v.numel()}
        if wrong:  # another bucket layout (--bucket-mb, or an hpctrain that cut buckets otherwise)
            index, n = next(iter(wrong.items()))
            return (f"the checkpoint's {self.compress} error feedback does not fit these buckets (bucket {index} holds "
                    f"{sizes.get(index, 0)} elements, its saved error {n}): it starts afresh; resume with the "
                    "--bucket-mb and hpctrain version the run was written with to keep it")
        self.compressor.load_state_dict(state, "cpu" if self._staging else self.device)
        return None

    def reduced(self, param: Any) -> Any:
        """The memory that holds `param`'s summed gradient after `wait()` (its `.grad`; with ZeRO, the slice of
        it this rank owns, for a parameter that was given as `alone`)."""
        return param.grad

    def grad_tensors(self) -> list[Any]:
        """The memory that holds the summed gradients after `wait()` (to unscale or check them)."""
        return [b.flat for b in self.buckets if b.flat is not None]

    def grad_bytes(self) -> int:
        """Bytes of gradient memory a step holds: the flat buckets, and the gradients reduced in place."""
        held = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets if b.flat is not None and not b.own)
        return held + sum(p.numel() * p.element_size() for b in self.buckets if b.own for p in b.params)

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
    def _make_bucket(self, index: int, group: list[Any]) -> Bucket:
        return owned_bucket(index, group, self.dtype, self.device)

    def _local_round(self) -> None:
        """A world of one: only the scaling is left to do."""
        for bucket in self.buckets:
            bind_bucket(bucket)
            if self.prescale * self.postscale != 1.0:
                bucket.flat.mul_(self.prescale * self.postscale)

    def _start_overlap(self, ordered: list[Any]) -> None:
        """Hook every parameter's gradient-ready event and (with overlap) start the communication thread."""
        for p in ordered:
            self._hooks.append(p.register_hook(self._guard(p)))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if self.overlap:
            self._thread = threading.Thread(target=self._run, name="hpctrain-comm", daemon=True)
            self._thread.start()

    def _begin_round(self) -> None:
        """The first gradient of a step is ready (or wait() came first): fix this round's scaling now, when
        the caller knows which batch it is (`scale_fn`), not when it zeroed the gradients."""
        if not self._in_round:
            self._in_round = True
            self._wire_round = 0
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
        start = time.perf_counter()
        try:
            self._mark_ready(param)
        finally:
            self.hook_seconds += time.perf_counter() - start

    def _guard(self, param: Any) -> Callable[[Any], None]:
        """A hook that runs before autograd accumulates `param`'s gradient: a second gradient for a parameter
        whose bucket may be on the wire is refused there, before autograd writes `.grad` while the
        communication thread binds it (two threads setting one tensor's `.grad` corrupt the heap)."""
        bucket = self._bucket_of[id(param)]

        def guard(grad: Any) -> None:
            if self.enabled and id(param) in bucket.ready:
                self._twice(param)

        return guard

    def _twice(self, param: Any) -> None:
        raise CommError(
            f"a gradient of shape {tuple(param.shape)} became ready twice before its allreduce was awaited: "
            "a second backward() ran before step() without no_sync(); run all but the last backward of "
            "an accumulation inside `with optimizer.no_sync():` (hpctrain train: --accumulate K)")

    def _mark_ready(self, param: Any) -> None:
        bucket = self._bucket_of[id(param)]
        with self._lock:
            self._begin_round()
            if id(param) in bucket.ready:  # its bucket may be on the wire: accumulating would race it
                self._twice(param)
            bucket.ready.add(id(param))
            # Launch strictly in bucket order so every rank issues the same sequence of collectives.
            while self._launched < len(self.buckets):
                nxt = self.buckets[self._launched]
                if len(nxt.ready) < len(nxt.params):
                    break
                self._launched += 1
                if self._thread is not None:
                    RECORDER.handoff(nxt.index)
                    self._queue.put(nxt)
                else:  # eager, inline: this thread runs backward and waits for the bucket's collective
                    self._reduce_guarded(nxt)

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

    def _reduce_guarded(self, bucket: Bucket) -> None:
        """Reduce `bucket`, keeping the first error for wait() to raise. After an error the remaining
        buckets are still reduced: every other rank enters their collectives, and a rank that skipped them
        would leave the others waiting forever. The one hook of the flight recorder for every bucket's sum
        (flat, hierarchical, rank-ordered, 16-bit, compressed, ZeRO's reduce-scatter): its bytes on the wire."""
        seq = RECORDER.begin(self.COLLECTIVE, bucket.index, self.compress if self.compress != "none" else self.dtype,
                             counter=self._wire_round, group=self.comm.flight)
        try:
            self._reduce(bucket)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() in the caller's thread
            if self._error is None:
                self._error = exc
        finally:
            RECORDER.end(seq, self._wire_round)

    def _needs_staging(self) -> bool:
        """Whether device gradients go through pinned host buffers: on a GPU rank whose MPI is not CUDA-aware,
        or whose start-up probe (one small allreduce from GPU memory, which must give the right sum) failed.

        Every rank takes part in the probe, a CPU rank or a staging one from host memory: it used to run on CUDA
        ranks only, so a job with a rank that sees no GPU mismatched every collective after it."""
        import torch

        cuda = self.device.type == "cuda"
        if self.comm.size == 1:
            return cuda  # nothing is ever sent
        direct = cuda and cuda_aware()
        if cuda and not direct:
            self.notes.append("MPI is not CUDA-aware: staging gradients through pinned host buffers")
        MPI = load_mpi()
        probe = torch.ones(4, device=self.device if direct else "cpu")
        try:
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(probe, MPI), op=MPI.SUM)
        except Exception as exc:  # noqa: BLE001 - from GPU memory, any failure means: stage through the host
            if not direct:
                raise
            self.notes.append(f"CUDA-aware allreduce failed at start-up ({exc}): staging through the host")
            return True
        if direct and not bool((probe == self.comm.size).all()):
            self.notes.append("CUDA-aware allreduce gave a wrong sum at start-up: staging through the host")
            return True
        return cuda and not direct

    def _reduce(self, bucket: Bucket) -> None:
        import torch

        MPI = load_mpi()
        bind_bucket(bucket)  # every gradient of the bucket is ready (or will get none this step)
        flat = bucket.flat
        if self.device.type == "cuda" and self._staging:
            if bucket.host is None:
                bucket.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            bucket.host.copy_(flat, non_blocking=False)
            self._reduce_host(bucket.host, bucket, MPI)
            flat.copy_(bucket.host, non_blocking=False)
        else:  # CUDA-aware or CPU: MPI reads the bucket itself (buffer_spec orders it after the stream's kernels)
            self._reduce_host(flat, bucket, MPI)

    def _reduce_host(self, flat: Any, bucket: Bucket, MPI: Any) -> None:
        if self.compressor is not None:
            self._reduce_compressed(flat, bucket, MPI)
            return
        self._wire_round += flat.numel() * (flat.element_size() if self.compress == "none" else 2)
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
        self._sum(bucket.wire, sum_op(self.compress, MPI), MPI)
        flat.copy_(bucket.wire).mul_(self.comm.size * self.postscale)

    def _reduce_compressed(self, flat: Any, bucket: Bucket, MPI: Any) -> None:
        """Low rank or sparse, with error feedback. The compressor sees the gradient without the loss scale,
        so its state (errors, warm starts) stays in the gradient's own units when the scale changes; under a
        loss scale, a bucket that holds an inf or NaN on any rank (an fp16 overflow: the step will be skipped)
        leaves every rank's state untouched, and the bucket becomes NaN on every rank so that the scaler's
        check skips the step everywhere. Deciding that costs one 8-byte allreduce per bucket, only then."""
        scaled = self.loss_scale is not None
        if scaled and not self._finite_everywhere(flat):
            flat.fill_(float("nan"))
            return
        unscale = self.prescale / (self.loss_scale if scaled else 1.0)
        if unscale != 1.0:
            flat.mul_(unscale)
        self._wire_round += self.compressor.reduce(bucket.index, flat, bucket.params,
                                                   lambda buf: self._sum(buf, MPI.SUM, MPI))
        rescale = self.postscale * (self.loss_scale if scaled else 1.0)
        if rescale != 1.0:
            flat.mul_(rescale)

    def _finite_everywhere(self, flat: Any) -> bool:
        """Whether no rank's part of this bucket holds an inf or NaN (the same answer on every rank)."""
        import torch

        bad = 0.0 if bool(torch.isfinite(flat).all()) else 1.0
        return self.comm.allreduce_array([bad], op="max")[0] == 0.0

    def _sum(self, buf: Any, op: Any, MPI: Any) -> None:
        """In-place sum of `buf` over all ranks: flat, hierarchical or in a fixed order."""
        if self.deterministic:
            self._ordered_sum(buf)
        elif self._local is not None:
            # node-local reduce to the node leader, leaders allreduce, node-local broadcast
            spec = buffer_spec(buf, MPI)
            if self._local.size > 1:
                self._local.mpi.Reduce(MPI.IN_PLACE if self._local.rank == 0 else spec, spec, op=op, root=0)
            if self._leaders is not None and self._leaders.size > 1:
                self._leaders.mpi.Allreduce(MPI.IN_PLACE, spec, op=op)
            if self._local.size > 1:
                self._local.mpi.Bcast(spec, root=0)
        else:
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(buf, MPI), op=op)

    def _ordered_sum(self, buf: Any, chunk: int = 1 << 22) -> None:
        """Sum in rank order (((g0 + g1) + g2) + ...), accumulating in float32, whatever MPI's algorithm:
        the same bits in every run and on every rank. Costs an allgather (W x the traffic), in chunks."""
        import torch

        MPI = load_mpi()
        flat = buf.view(-1)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            gathered = torch.empty((self.comm.size, part.numel()), dtype=part.dtype, device=part.device)
            self.comm.mpi.Allgather(buffer_spec(part.contiguous(), MPI), buffer_spec(gathered, MPI))
            total = gathered[0].float()
            for r in range(1, self.comm.size):
                total += gathered[r].float()
            part.copy_(total)
