"""The gradient engine: `GradSync` owns the buckets, the hooks on the parameters, the communication thread and
the step protocol; a small strategy per ZeRO stage says what happens at its two moments, after backward (a
bucket's gradients are ready) and before forward (the parameters a forward reads).

| stage | after backward (per bucket) | before forward |
|---|---|---|
| 0 (`allreduce.WholeGradients`) | allreduce in place | nothing |
| 1 (`zero.ShardedState`) | reduce-scatter into this rank's slice | allgather of the stepped slices, after the step |
| 2 (`zero.ShardedState`) | pack, reduce-scatter, free the bucket's gradients | as stage 1 |
| 3 (`zero3.ShardedParams`) | as stage 2, then free the gathered parameters | allgather of each unit's parameters in its forward (and again in its backward), the next one prefetched |

Autograd owns the gradients, as in a plain torch step: `zero()` drops them (`.grad = None`), so backward
neither zeroes nor accumulates into old memory, it hands over fresh tensors. Measured on the reference MLP:
the zeroing pass and the accumulation into persistent bucket views cost more than the small copies do
(`hpctrain bench train`, docs/performance.md, "The step against the honest limit"). A bucket's collective
runs on a dedicated communication thread as soon as all of its gradients are ready (with overlap), inline in
backward (stages 2 and 3 without overlap, to free memory early) or in `wait()`. Every collective of a step
(ZeRO 3's parameter gathers too) runs on that one thread with overlap, so that every rank issues them in the
same order. The collectives themselves are in collectives.py, the wire formats in wire.py. The flight recorder
(trace/flight.py) sees every one of them: each bucket's sum in `_reduce_guarded` (named by the strategy's
`COLLECTIVE`), each parameter gather in `gather` (ZeRO's allgathers, stage 3's prefetches included).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from ..base.config import ZeroConfig, parse_grad_compression, zero_refusal
from ..base.errors import CommError, ConfigError
from ..base.hostmem import give_back_freed_memory, reuse_freed_memory
from ..base.threads import join_logged
from ..trace.flight import RECORDER
from . import compress as compression
from .allreduce import WholeGradients
from .buckets import Bucket, trainable_in_backward_order
from .buffers import broadcast_buffers, buffer_slots
from .collectives import Collectives
from .wire import buffer_spec, wire_bytes
from .world import Comm, cuda_aware, load_mpi
from .zero import ShardedState, grads_into_slices, make_segments, unpacked, whole_grads
from .zero3 import ShardedParams


def refuse(stage: int, compress: str, hierarchical: bool, reduce: str, module: Any, alone: list[Any] = ()) -> None:
    """What does not compose with ZeRO `stage`, refused in one line before anything is built: the config's
    rules (a stage, a reducer, the gradient sums ZeRO cannot shard: base/config.py, the one place they are
    written, for the library API that builds no TrainConfig), then what only the engine sees (the model)."""
    ZeroConfig(stage=stage, reduce=reduce)
    refusal = zero_refusal(stage, compress, hierarchical)
    if refusal is not None:
        raise refusal
    if stage == 3 and module is None:
        raise ConfigError("--zero 3 shards the parameters by module: give the model (module=model), not only "
                          "its parameters")
    if stage == 3 and alone:
        raise ConfigError("--zero 3 keeps each module's parameters in one bucket, so no parameter can be reduced "
                          "alone (a pipeline's tied embedding/head asks for that): use --zero 2")


class GradSync:
    """The gradients of a model summed over `comm` at ZeRO `stage` (0: allreduce; 1-3: see the module).

    A step is `zero()`, forward, backward, `wait()` (every bucket is reduced: each `.grad` holds the sum over
    ranks at stage 0, each owned slice at stages 1-3), the optimizer step, `after_step()` (stages 1 and 2
    allgather the parameters; `ShardedOptimizer.step` calls it). Buckets are reduced in the same order on every
    rank, so ranks that skip a parameter cannot mismatch collectives (its slice is reduced as zeros).

    The caller scales its loss so that the summed gradient is the one it wants (the trainer divides by the
    global sample count of the step), and calls `zero()` instead of `optimizer.zero_grad()`. Stage 3 needs
    the model (`module`): its parameters are sharded by module (zero3.py).
    """

    OWN_BYTES = 1 << 18  # a gradient this large is a bucket alone, reduced from its own memory

    def __init__(self, params: Iterable[Any], comm: Comm, *, stage: int = 0, module: Any = None,
                 bucket_mb: float = 25.0, overlap: bool = True, compress: str = "none", hierarchical: bool = False,
                 deterministic: bool = False, node_key: int | None = None, reduce: str = "auto",
                 alone: Iterable[Any] = ()):
        if bucket_mb <= 0:
            raise ConfigError(f"--bucket-mb {bucket_mb} must be positive, e.g. 4")
        alone = list(alone)
        refuse(stage, compress, hierarchical, reduce, module, alone)
        kind, _ = parse_grad_compression(compress)
        reuse_freed_memory()  # zero() drops the gradients every step: their memory is kept for the next
        self.comm, self.stage = comm, stage
        self.buffers = buffer_slots(module)  # rank 0's after every step (`buffers.py`)
        self.compress = kind  # none, fp16 or bf16 on the wire; powersgd and topk: `compressor`
        self.compressor = compression.make(compress, comm)
        self.wire_bytes = 0  # what this rank put on the wire in the last step (its payload)
        self.wire_round = 0
        self.overlap = overlap and comm.size > 1
        self.enabled = True
        ordered = trainable_in_backward_order(params)
        self.dtype, self.device = ordered[0].dtype, ordered[0].device
        self.notes: list[str] = []
        self.strategy: Any = (WholeGradients(self) if stage == 0 else ShardedState(self, stage) if stage < 3
                              else ShardedParams(self, module))
        self.buckets: list[Bucket] = self.strategy.build(ordered, bucket_mb, alone)
        self._bucket_of: dict[int, Bucket] = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.params = [p for b in self.buckets for p in b.params]
        self.colls = Collectives(comm, deterministic=deterministic, hierarchical=hierarchical, node_key=node_key)
        self.deterministic = self.colls.deterministic
        self.staging = self._needs_staging()  # device memory goes to MPI through pinned host buffers
        # eager: without overlap, still reduce each bucket as soon as backward has filled it, inline in the
        # backward (stages that free gradient memory per bucket want this; the allreduce does not)
        self.eager = self.strategy.eager and comm.size > 1
        self._queue: queue.Queue[tuple[Callable[[], None], threading.Event] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._launched = 0
        self._lock = threading.Lock()
        self._hooks: list[Any] = []
        self._thread: threading.Thread | None = None
        self._start_hooks(ordered)
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
        self._whole = False  # `whole_grads()` gave the `.grad`s this step's whole gradients
        self.segments = make_segments(self.buckets, comm.size, comm.rank) if stage else []
        if stage and not self.segments:
            raise ConfigError(f"--zero {stage}: the model has fewer trainable elements than there are ranks "
                              f"({comm.size}), so rank {comm.rank} owns nothing; use --zero 0")
        self.reduce, self.probe = "allreduce", ""
        if stage:
            self._choose_reducer(reduce)
        if stage == 3:  # the whole model was built, then freed but for this rank's slices: give it back
            give_back_freed_memory()
        self.strategy.start()

    # -- the public step protocol ------------------------------------------------------------------
    def zero(self) -> None:
        """Before the next step: drop every gradient (`.grad = None`, as torch's `zero_grad()` does); the next
        backward hands over fresh ones.

        Buckets still on the wire (backward ran, step() did not) are awaited first: touching memory that is
        being reduced would race the reduction, and skipping their collectives would strand other ranks."""
        if self._in_round and self._launched:
            self.wait()
        self._end_round()
        self._whole = False
        for bucket in self.buckets:
            if bucket.own:
                bucket.flat = None  # the gradient's memory goes with it
            for p in bucket.params:
                p.grad = None

    def wait(self) -> None:
        """Finish the reduction of every bucket; afterwards each `.grad` (stage 0) or owned slice holds the sum."""
        if not self.enabled:
            return
        start = time.perf_counter()
        with self._lock:
            self._begin_round()
            pending = self.buckets[self._launched:]
            self._launched = len(self.buckets)
        for bucket in pending:  # those the backward did not launch (all of them at stage 0 without overlap)
            self._launch(bucket)
        for bucket in self.buckets:
            self.await_done(bucket.done)
        self._end_round()
        self.strategy.settle()
        self._broadcast_buffers()
        self.wire_bytes = self.wire_round
        if self._error is not None:
            error, self._error = self._error, None
            raise CommError(f"gradient reduction failed on rank {self.comm.rank}: {error!r}") from error
        self.comm_seconds = time.perf_counter() - start

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank (BatchNorm's statistics: each rank's forward updated its own), after the
        step's forwards, in order with the step's other collectives (on the communication thread with overlap)."""
        if not self.buffers or self.comm.size == 1:
            return
        done, failed = threading.Event(), []

        def task() -> None:
            try:
                broadcast_buffers(self.comm, self.buffers, staged=self.staging)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(exc)

        self.submit(task, done)
        self.await_done(done)
        if failed:
            raise CommError(f"broadcasting the model's buffers failed on rank {self.comm.rank}: {failed[0]!r}") from failed[0]

    def whole_grads(self) -> None:
        """After `wait()`: every `.grad` the whole reduced gradient, at every stage (zero.py `whole_grads`)."""
        self._whole = whole_grads(self)

    def before_step(self) -> None:
        """The optimizer steps this rank's slices now: after `whole_grads()`, as the caller left the `.grad`s."""
        self._whole = self._whole and grads_into_slices(self)

    def after_step(self) -> None:
        """Once the optimizer has stepped the owned slices: stages 1 and 2 allgather the parameters."""
        self.strategy.after_step()

    def params_written(self) -> None:
        """This rank's parameters (its slices, sharded) were written outside a step: loaded from a checkpoint."""
        self.strategy.params_written()

    def gather_params(self) -> None:
        """The allgather of the stepped parameters (stages 1 and 2): `after_step`, under its former name."""
        self.after_step()

    def submit(self, task: Callable[[], None], done: threading.Event) -> None:
        """Run `task` (a collective) on the communication thread, in submission order, and set `done` after it;
        inline without the thread. Every collective of a step goes through here, so that all ranks issue them
        in the same order."""
        if self._thread is None:
            try:
                task()
            finally:
                done.set()
        else:
            self._queue.put((task, done))

    def _launch(self, bucket: Bucket) -> None:
        """Submit `bucket`'s reduction (the flight recorder notes when a bucket is handed to the thread)."""
        self.strategy.launching(bucket)  # in program order: what it decides, every rank decides alike
        if self._thread is not None:
            RECORDER.handoff(bucket.index)
        self.submit(lambda: self._reduce_guarded(bucket), bucket.done)

    def gather(self, bucket: Bucket, full: Any, shard: Any = None) -> None:
        """Every rank's slice of `bucket`'s parameters into `full` (from `shard`, or in place), as the flight
        recorder sees it: ZeRO's allgathers, after the step (stages 1 and 2) or a unit's (stage 3)."""
        seq = RECORDER.begin("allgather", bucket.index, self.dtype, nbytes=full.numel() * full.element_size(),
                             group=self.comm.flight)
        try:
            self.colls.allgather(full, bucket.counts, shard)
        finally:
            RECORDER.end(seq)

    def compressor_state(self) -> dict[str, Any] | None:
        """The compressor's per-rank state (error feedback, warm starts) for a checkpoint; None without one."""
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_compressor_state(self, state: dict[str, Any]) -> str | None:
        """Restore `compressor_state()`; its tensors move to the memory the compressor works on (a checkpoint
        loads on the CPU): the gradients' device, or the host when device gradients are staged through it.
        State saved for another bucket layout is not loaded; the returned line says so (None: loaded)."""
        if self.compressor is None:
            return None
        sizes = {b.index: b.numel for b in self.buckets}
        wrong = {int(k): v.numel() for k, v in state.get("errors", {}).items() if sizes.get(int(k)) != v.numel()}
        if wrong:  # another bucket layout (--bucket-mb, or an hpctrain that cut buckets otherwise)
            index, n = next(iter(wrong.items()))
            return (f"the checkpoint's {self.compress} error feedback does not fit these buckets (bucket {index} holds "
                    f"{sizes.get(index, 0)} elements, its saved error {n}): it starts afresh; resume with the "
                    "--bucket-mb and hpctrain version the run was written with to keep it")
        self.compressor.load_state_dict(state, "cpu" if self.staging else self.device)
        return None

    def reduced(self, param: Any) -> Any:
        """The memory that holds `param`'s summed gradient after `wait()`: its `.grad` at stage 0; with ZeRO,
        this rank's slice of it (flat), for a parameter that is a bucket alone (given as `alone`)."""
        if not self.stage:
            return param.grad
        bucket = self._bucket_of[id(param)]
        if len(bucket.params) != 1:
            raise ValueError("GradSync.reduced: at ZeRO stages 1-3 the parameter shares its bucket; pass it as `alone`")
        return bucket.shard

    def grad_tensors(self) -> list[Any]:
        """The memory that holds this rank's summed gradients after `wait()` (to unscale, check or clip them)."""
        return self.strategy.grad_tensors()

    def grad_bytes(self) -> int:
        """Bytes of gradient memory this rank holds now."""
        return self.strategy.grad_bytes()

    def param_bytes(self) -> int:
        """Bytes of parameter memory this rank holds now (at stage 3: its slices and the gathered units)."""
        held = getattr(self.strategy, "param_bytes", None)
        return held() if held is not None else sum(p.numel() * p.element_size() for p in self.params)

    def count_wire(self, numel: int, element_size: int) -> None:
        """Add a collective's payload to this step's wire bytes."""
        self.wire_round += wire_bytes(numel, element_size, self.compress)

    def close(self) -> None:
        """Stop the communication thread and remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.strategy.close()
        if self._thread is not None:
            self._queue.put(None)
            join_logged(self._thread, 30.0, "gradient reduction")
            self._thread = None

    # -- internals ---------------------------------------------------------------------------------
    def _choose_reducer(self, reduce: str) -> None:
        """The reducer of ZeRO's reduce-scatter: the one named, or with auto the fastest on the largest bucket
        (timed once here; the same choice on every rank)."""
        import torch

        if reduce == "auto" and self.comm.size > 1 and not self.deterministic:
            bucket = max(self.buckets, key=lambda b: b.numel)
            send = torch.ones(bucket.numel, dtype=self.dtype, device=self.device)
            out = torch.empty_like(bucket.shard)
            if send.is_cuda and self.staging:  # staged: the collective runs on host memory
                send, out = send.cpu(), out.cpu()
            self.reduce = "allreduce"  # would it sum this bucket unpacked? then the others pay a packed copy
            packed = self.stage >= 2 and unpacked(self, bucket)
            reduce, self.probe = self.colls.fastest_reducer(send, out, bucket.counts, packed)
            del send, out
        self.reduce = self.colls.reducer = reduce if reduce != "auto" else "reduce-scatter"
        self.notes.append(f"ZeRO stage {self.stage}: gradients summed by {self.reduce}" + (
            f" (timed at start-up: {self.probe})" if self.probe else ""))

    def _start_hooks(self, ordered: list[Any]) -> None:
        """Hook every parameter's gradient-ready event and (with overlap) start the communication thread."""
        if not (self.overlap or self.eager or self.stage == 3):
            return
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
            self.wire_round = 0
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
            self.strategy.accumulated(param)  # stage 3: a unit's backward is done even without a reduction
            return
        if not (self.overlap or self.eager):
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
            f"a gradient of shape {tuple(param.shape)} became ready twice before its reduction was awaited: "
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
                self._launch(nxt)

    @property
    def threaded(self) -> bool:
        """Whether collectives run on the communication thread (overlap), not inline."""
        return self._thread is not None

    def bucket_of(self, param: Any) -> Bucket:
        return self._bucket_of[id(param)]

    def owns(self, tensor: Any) -> bool:
        """Whether `tensor` is one of the parameters this engine reduces."""
        return id(tensor) in self._bucket_of

    def state_items(self, model: Any) -> Iterator[tuple[str, Any]]:
        """(key, parameter or buffer) of `model.state_dict(keep_vars=True)`, whole while it is handed out: at
        stage 3 each unit is gathered while its keys are read (a collective: every rank iterates to the end),
        at stages 0-2 every rank holds them."""
        if self.stage == 3:
            yield from self.strategy.whole(model)
        else:
            yield from model.state_dict(keep_vars=True).items()

    def await_done(self, done: threading.Event) -> None:
        """Wait for a submitted collective; raise if the communication thread died."""
        while not done.wait(1.0):  # the thread always sets it; bounded to notice a dead one
            if self._thread is None or not self._thread.is_alive():
                raise CommError("the communication thread is gone; this is a bug, please report it")

    def _run(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            task, done = item
            try:
                task()
            finally:
                done.set()

    def _reduce_guarded(self, bucket: Bucket) -> None:
        """Reduce `bucket`, keeping the first error for wait() to raise. After an error the remaining
        buckets are still reduced: every other rank enters their collectives, and a rank that skipped them
        would leave the others waiting forever. The one hook of the flight recorder for every bucket's sum
        (flat, hierarchical, rank-ordered, 16-bit, compressed, ZeRO's reduce-scatter): its bytes on the wire."""
        seq = RECORDER.begin(self.strategy.COLLECTIVE, bucket.index,
                             self.compress if self.compress != "none" else self.dtype, counter=self.wire_round,
                             group=self.comm.flight)
        try:
            self.strategy.reduce(bucket)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() in the caller's thread
            if self._error is None:
                self._error = exc
        finally:
            RECORDER.end(seq, self.wire_round)

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


def ZeroSync(params: Iterable[Any], comm: Comm, *, stage: int, module: Any = None, **options: Any) -> GradSync:  # noqa: N802
    """The gradient engine at ZeRO `stage` 1, 2 or 3 (the name this constructor has had since stage 1)."""
    if stage not in (1, 2, 3):
        raise ConfigError(f"ZeRO stage {stage!r} must be 1 (optimizer state), 2 (also gradients) or 3 (also "
                          "parameters)")
    return GradSync(params, comm, stage=stage, module=module, **options)
