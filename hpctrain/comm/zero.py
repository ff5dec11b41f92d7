"""ZeRO stages 1 and 2 over MPI: `ZeroSync` shards gradients and parameter updates across the ranks.

The parameters are cut into the same flat buckets as `GradSync`'s (in backward order), and each bucket into
one contiguous slice per rank (`shard_bounds`: slice sizes differ by at most one element). Every parameter
becomes a view into its bucket's flat parameter buffer, so the rank that owns a slice updates it in place,
and one in-place MPI Allgather per bucket gives every rank the new parameters (`gather_params`).

Gradients are reduce-scattered: each rank receives the sum of its own slice only, in `bucket.shard`. The
collective is MPI Reduce_scatter_block (slices of equal size), Reduce_scatter, or an Allreduce of which each
rank keeps its slice: `reduce="auto"` times each once on the largest bucket at start-up and keeps the
fastest (every rank the same choice). MPI libraries differ here: Open MPI 4.1 on one node sums 23 MB with
Allreduce in 2.7 ms, with Reduce_scatter in 6 ms and with Reduce_scatter_block in 13 ms, while on a network
a reduce-scatter sends half the bytes of an allreduce.
- Stage 1 holds gradients as GradSync does (autograd's own; a large one a bucket alone, reduce-scattered
  from its own memory, small ones packed into a flat buffer): gradient memory stays whole, optimizer state
  is sharded.
- Stage 2 lets autograd produce fresh gradients; once backward has filled a bucket, its gradients are
  packed into one buffer (one, reused for every bucket; a bucket of one parameter is sent from its gradient
  directly), the `.grad`s are dropped and the buffer is reduce-scattered. A bucket's full gradient lives only while it is being
  sent, so stage 2 reduces each bucket as soon as it is full even without overlap (inline in backward).

The wire format (fp16/bf16), the rank-ordered deterministic sum and the host staging of device memory work
as in GradSync. The optimizer that steps the owned slices is `ShardedOptimizer` (zerooptim.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..base.config import ZERO_REDUCERS as REDUCERS
from ..base.errors import ConfigError
from ..trace.flight import RECORDER
from .buckets import Bucket, bind_bucket, owned_bucket
from .gradsync import GradSync
from .wire import buffer_spec, sum_op
from .world import Comm, load_mpi


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's slice of `n` elements: contiguous, in rank order, sizes within one element."""
    base, extra = divmod(n, world)
    bounds, lo = [], 0
    for r in range(world):
        hi = lo + base + (r < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def plan_segments(numels: list[list[int]], world: int, rank: int) -> list[tuple[int, int, int, int]]:
    """The parts of parameters that `rank` owns, given each bucket's parameter sizes in bucket order:
    (bucket, position of the parameter in its bucket, start, stop) with [start, stop) in the flattened
    parameter. A pure function: every rank (and a checkpoint reader) can compute any rank's plan."""
    out = []
    for b, sizes in enumerate(numels):
        lo, hi = shard_bounds(sum(sizes), world)[rank]
        offset = 0
        for i, n in enumerate(sizes):
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                out.append((b, i, start - offset, stop - offset))
            offset += n
    return out


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements [start, stop) of the flattened `param` that this rank owns; `tensor` is the optimizer's
    leaf over them (a view into the bucket's parameter memory, its `.grad` a view into the reduced slice)."""

    param: Any
    start: int
    stop: int
    tensor: Any


class _ZeroBucket(Bucket):
    """A bucket with its flat parameter buffer and this rank's reduced gradient slice [lo, hi)."""

    __slots__ = ("param_flat", "counts", "lo", "hi", "shard")


class ZeroSync(GradSync):
    """Reduce-scatter of a model's gradients into per-rank slices, and the allgather of updated parameters.

    After `ZeroSync(params, comm, stage=1|2)` the parameters are views into flat buckets; `segments` lists
    the parts this rank owns (build the optimizer over them: `ShardedOptimizer`). A step is `zero()`,
    backward, `wait()` (every owned slice of `.grad` is reduced, scaled as in GradSync), the optimizer step
    on the segments, `gather_params()`.
    """

    COLLECTIVE = "reduce-scatter"

    def __init__(self, params: Iterable[Any], comm: Comm, *, stage: int, bucket_mb: float = 25.0,
                 overlap: bool = True, compress: str = "none", deterministic: bool = False,
                 hierarchical: bool = False, reduce: str = "auto", alone: Iterable[Any] = ()):
        if stage not in (1, 2):
            raise ConfigError(f"ZeRO stage {stage!r} must be 1 (optimizer state) or 2 (also gradients)")
        if hierarchical:
            raise ConfigError(f"--zero {stage} does not combine with --hierarchical (ZeRO reduce-scatters over all "
                              "ranks at once): drop one of them")
        self.probe = ""
        if compress.partition(":")[0] in ("powersgd", "topk"):
            raise ConfigError(f"--grad-compression {compress} does not combine with --zero {stage} (ZeRO sums each "
                              "rank's slice; PowerSGD and top-k need whole gradients): drop one of them")
        if reduce not in REDUCERS:
            raise ConfigError(f"--zero-reduce {reduce!r}: choose one of {', '.join(REDUCERS)}")
        self.stage = stage
        self._pack_buffer: Any = None  # stage 2: the one buffer every bucket's gradients are packed into
        self.EAGER = stage == 2  # free each bucket's gradients as soon as backward has filled it
        super().__init__(params, comm, bucket_mb=bucket_mb, overlap=overlap, compress=compress,
                         deterministic=deterministic, alone=alone)
        self.params = [p for b in self.buckets for p in b.params]
        numels = [[p.numel() for p in b.params] for b in self.buckets]
        self.segments: list[Segment] = []
        for b, i, start, stop in plan_segments(numels, comm.size, comm.rank):
            bucket = self.buckets[b]
            at = sum(numels[b][:i])
            leaf = _leaf(bucket.param_flat[at + start:at + stop])
            leaf.grad = bucket.shard[at + start - bucket.lo:at + stop - bucket.lo]
            self.segments.append(Segment(bucket.params[i], start, stop, leaf))
        if not self.segments:
            raise ConfigError(f"--zero {stage}: the model has fewer trainable elements than there are ranks "
                              f"({comm.size}), so rank {comm.rank} owns nothing; use --zero 0")
        self.reduce = reduce if reduce != "auto" or comm.size == 1 or self.deterministic else self._fastest()
        self.notes.append(f"ZeRO stage {stage}: gradients summed by {self.reduce}" + (
            f" (timed at start-up: {self.probe})" if self.probe else ""))

    # -- the step protocol -------------------------------------------------------------------------
    def gather_params(self) -> None:
        """Every rank's updated slices to every rank: one in-place Allgather per bucket."""
        if self.comm.size == 1:
            return
        MPI = load_mpi()
        for bucket in self.buckets:
            flat = bucket.param_flat
            host = flat.cpu() if flat.is_cuda and self._staging else flat
            seq = RECORDER.begin("allgather", bucket.index, self.dtype, nbytes=host.numel() * host.element_size(),
                                 group=self.comm.flight)
            if len(set(bucket.counts)) == 1:
                self.comm.mpi.Allgather(MPI.IN_PLACE, buffer_spec(host, MPI))
            else:
                self.comm.mpi.Allgatherv(MPI.IN_PLACE, _vspec(host, bucket.counts, MPI))
            RECORDER.end(seq)
            if host is not flat:
                flat.copy_(host)

    def reduced(self, param: Any) -> Any:
        """This rank's slice of `param`'s summed gradient (a parameter given as `alone`: its bucket's slice)."""
        bucket = self._bucket_of[id(param)]
        if len(bucket.params) != 1:
            raise ValueError("ZeroSync.reduced: the parameter shares its bucket; pass it as `alone`")
        return bucket.shard

    def grad_tensors(self) -> list[Any]:
        """This rank's reduced slices: all of the summed gradient it holds after `wait()`."""
        return [b.shard for b in self.buckets]

    def grad_bytes(self) -> int:
        """Bytes of gradient memory this rank holds now: flat buckets (stage 1), reduced slices, and any
        `.grad` not yet packed and the packing buffer (stage 2)."""
        held = sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)
        if self._pack_buffer is not None:
            held += self._pack_buffer.numel() * self._pack_buffer.element_size()
        if self.stage == 1:
            return held + super().grad_bytes()
        return held + sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    # -- internals ---------------------------------------------------------------------------------
    def _make_bucket(self, index: int, group: list[Any]) -> Bucket:
        """Flat parameter memory for `group` (its parameters become views into it), this rank's reduced
        gradient slice, and at stage 1 the flat gradient bucket."""
        import torch

        n = sum(p.numel() for p in group)
        bucket = _ZeroBucket(index, None, group)
        if self.stage == 1:  # gradients as GradSync holds them: a large one alone, small ones packed
            owned = owned_bucket(index, group, self.dtype, self.device)
            bucket.flat, bucket.views, bucket.own = owned.flat, owned.views, owned.own
        bucket.param_flat = torch.empty(n, dtype=self.dtype, device=self.device)
        offset = 0
        for p in group:
            k = p.numel()
            bucket.param_flat[offset:offset + k].copy_(p.detach().reshape(-1))
            p.data = bucket.param_flat[offset:offset + k].view_as(p)
            offset += k
        bounds = shard_bounds(n, self.comm.size)
        bucket.counts = [hi - lo for lo, hi in bounds]
        bucket.lo, bucket.hi = bounds[self.comm.rank]
        bucket.shard = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        return bucket

    def _local_round(self) -> None:
        for bucket in self.buckets:
            self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> None:
        if self.stage == 1:
            bind_bucket(bucket)
        send = bucket.flat if self.stage == 1 else self._pack(bucket)
        self._reduce_scatter(send, bucket)  # stage 2: `send` is freed on return

    def _pack(self, bucket: _ZeroBucket) -> Any:
        """Stage 2: the bucket's gradients in one flat buffer (zeros for a parameter that got none); the
        `.grad`s are dropped. A bucket of one parameter sends that parameter's gradient as it is."""
        import torch

        if len(bucket.params) == 1:
            p = bucket.params[0]
            grad = p.grad.reshape(-1).contiguous() if p.grad is not None else torch.zeros(p.numel(), dtype=self.dtype,
                                                                                           device=self.device)
            p.grad = None
            return grad
        n = sum(p.numel() for p in bucket.params)
        if self._pack_buffer is None:
            largest = max(sum(p.numel() for p in b.params) for b in self.buckets if len(b.params) > 1)
            self._pack_buffer = torch.empty(largest, dtype=self.dtype, device=self.device)
        packed, offset = self._pack_buffer[:n], 0
        for p in bucket.params:
            k = p.numel()
            if p.grad is None:
                packed[offset:offset + k].zero_()
            else:
                packed[offset:offset + k].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += k
        return packed

    def _reduce_scatter(self, send: Any, bucket: _ZeroBucket) -> None:
        """Sum `send` over the ranks into this rank's slice `bucket.shard`, scaled and on the wire format."""
        import torch

        out = bucket.shard
        scale = self.prescale * self.postscale
        if self.comm.size == 1:
            out.copy_(send[bucket.lo:bucket.hi])
            if scale != 1.0:
                out.mul_(scale)
            return
        MPI = load_mpi()
        self._wire_round += send.numel() * (send.element_size() if self.compress == "none" else 2)  # the payload
        staged = send.is_cuda and self._staging
        if staged:
            send, out = send.cpu(), torch.empty(out.shape, dtype=out.dtype)
        if self.compress == "none":
            if self.prescale != 1.0:
                send.mul_(self.prescale)
            self._scatter_sum(send, out, bucket, MPI.SUM)
            if self.postscale != 1.0:
                out.mul_(self.postscale)
        else:
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.compress]
            # pre-divide by the world size so that the 16-bit sum cannot overflow, then scale back
            wire = torch.mul(send, self.prescale / self.comm.size).to(dtype)
            wire_out = torch.empty(out.shape, dtype=dtype, device=out.device)
            self._scatter_sum(wire, wire_out, bucket, sum_op(self.compress, MPI))
            out.copy_(wire_out).mul_(self.comm.size * self.postscale)
        if staged:
            bucket.shard.copy_(out)

    def _scatter_sum(self, send: Any, out: Any, bucket: _ZeroBucket, op: Any, how: str | None = None) -> None:
        """This rank's slice of the sum of `send` over the ranks, into `out`, by `how` (the chosen reducer)."""
        MPI = load_mpi()
        counts = bucket.counts
        how = how or self.reduce
        if self.deterministic:
            self._ordered_scatter_sum(send, out, counts)
        elif how == "allreduce":
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(send, MPI), op=op)
            out.copy_(send[bucket.lo:bucket.hi])
        elif how == "reduce-scatter-block" and len(set(counts)) == 1:
            self.comm.mpi.Reduce_scatter_block(buffer_spec(send, MPI), buffer_spec(out, MPI), op=op)
        else:
            self.comm.mpi.Reduce_scatter(buffer_spec(send, MPI), buffer_spec(out, MPI), recvcounts=counts, op=op)

    def _fastest(self) -> str:
        """Time each reducer on the largest bucket (median of 3 after a warm-up, the slowest rank's) and
        return the fastest; the times are the same on every rank, and so is the choice."""
        import time

        import torch

        MPI = load_mpi()
        bucket = max(self.buckets, key=lambda b: sum(b.counts))
        send = torch.ones(sum(bucket.counts), dtype=self.dtype, device=self.device)
        out = torch.empty_like(bucket.shard)
        times = []
        if send.is_cuda and self._staging:  # staged: the collective runs on host memory
            send, out = send.cpu(), out.cpu()
        for how in REDUCERS[1:]:
            runs = []
            for _ in range(4):
                if send.is_cuda:
                    torch.cuda.synchronize(send.device)
                start = time.perf_counter()
                self._scatter_sum(send, out, bucket, MPI.SUM, how)
                runs.append(time.perf_counter() - start)
            times.append(sorted(runs[1:])[1])
        slowest = self.comm.allreduce_array(times, op="max")
        self.probe = ", ".join(f"{how} {t * 1e3:.2f} ms" for how, t in zip(REDUCERS[1:], slowest))
        return REDUCERS[1 + int(slowest.argmin())]

    def _ordered_scatter_sum(self, send: Any, out: Any, counts: list[int]) -> None:
        """Each rank receives every rank's copy of its slice (Alltoallv) and sums them in rank order,
        accumulating in float32: the same bits in every run, whatever MPI's algorithm."""
        import torch

        MPI = load_mpi()
        mine = counts[self.comm.rank]
        received = torch.empty(self.comm.size * mine, dtype=send.dtype, device=send.device)
        self.comm.mpi.Alltoallv(_vspec(send, counts, MPI), _vspec(received, [mine] * self.comm.size, MPI))
        total = received[:mine].float()
        for r in range(1, self.comm.size):
            total += received[r * mine:(r + 1) * mine].float()
        out.copy_(total)


def _leaf(view: Any) -> Any:
    """An optimizer leaf sharing `view`'s memory (a step on it updates the bucket in place)."""
    import torch

    return torch.nn.Parameter(view, requires_grad=True)


def _vspec(tensor: Any, counts: list[int], MPI: Any) -> list[Any]:
    """An mpi4py buffer spec with per-rank counts and displacements (the v-collectives)."""
    displs, at = [], 0
    for c in counts:
        displs.append(at)
        at += c
    spec = buffer_spec(tensor, MPI)
    if isinstance(spec, list):  # 16-bit: [raw memory, the 2-byte datatype]
        return [spec[0], (counts, displs), spec[1]]
    return [spec, (counts, displs)]
