"""ZeRO stages 1 and 2 of the gradient engine: gradients reduce-scattered into each rank's slice, the optimizer
stepping only that slice, the parameters allgathered after the step.

The parameters are cut into the same flat buckets as the allreduce's (in backward order), and each bucket into
one contiguous slice per rank (`buckets.shard_bounds`: slice sizes differ by at most one element). Every
parameter becomes a view into its bucket's flat parameter buffer, so the rank that owns a slice updates it in
place, and one in-place MPI Allgather per bucket gives every rank the new parameters (`after_step`).

Gradients are reduce-scattered: each rank receives the sum of its own slice only, in `bucket.shard`, by the
reducer `--zero-reduce` names or `auto` measured (collectives.py).
- Stage 1 holds gradients as the allreduce does (autograd's own; a large one a bucket alone, reduce-scattered
  from its own memory, small ones packed into a flat buffer): gradient memory stays whole, optimizer state
  is sharded.
- Stage 2 lets autograd produce fresh gradients; once backward has filled a bucket, its gradients are packed
  into one buffer (one, reused for every bucket; a bucket of one parameter is sent from its gradient directly),
  the `.grad`s are dropped and the buffer is reduce-scattered. A bucket's full gradient lives only while it is
  sent, so stage 2 reduces each bucket as soon as it is full even without overlap (inline in backward).

The parameter allgather is the "before forward" of these stages, run right after the optimizer step rather
than at the next forward: a checkpoint, a validation pass or the user's code between the two read the
parameters. The optimizer that steps the owned slices is `ShardedOptimizer` (zerooptim.py); stage 3 is zero3.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base.config import ZeroConfig, zero_refusal
from ..base.errors import ConfigError
from .buckets import (Bucket, Cut, Engine, Footprint, Strategy, assign_buckets, bind_bucket, flatten_params,
                      owned_bucket, pack, plan_segments, sharded_bucket)
from .wire import scaled_sum
from .world import load_mpi
from .zerooptim import ShardedOptimizer


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements [start, stop) of the flattened `param` that this rank owns; `tensor` is the optimizer's
    leaf over them (a view into the bucket's owned parameter slice, its `.grad` a view into the reduced slice)."""

    param: Any
    start: int
    stop: int
    tensor: Any


def make_segments(buckets: list[Bucket], world: int, rank: int) -> list[Segment]:
    """The optimizer's leaves over this rank's slices of `buckets` (which hold `owned` and `shard`)."""
    import torch

    numels = [[p.numel() for p in b.params] for b in buckets]
    segments = []
    for b, i, start, stop in plan_segments(numels, world, rank):
        bucket = buckets[b]
        at = sum(numels[b][:i]) - bucket.lo  # the parameter's offset in this rank's slice
        leaf = torch.nn.Parameter(bucket.owned[at + start:at + stop], requires_grad=True)
        leaf.grad = bucket.shard[at + start:at + stop]
        segments.append(Segment(bucket.params[i], start, stop, leaf))
    return segments


def staging(bucket: Bucket, dtype: Any) -> tuple[Any, Any]:
    """Pinned host memory of a staged bucket (device memory on an MPI that is not CUDA-aware), allocated once and
    reused every step: the whole bucket (`bucket.host`, as stage 0 stages) and this rank's slice. Fresh pageable
    memory per collective costs far more than the copies (its host pages faulted in anew by every gather and
    every reduce-scatter; docs/performance.md, the GPU machine)."""
    import torch

    if bucket.host is None or bucket.host.dtype != dtype:
        bucket.host = torch.empty(bucket.numel, dtype=dtype, pin_memory=True)
    if bucket.host_shard is None or bucket.host_shard.dtype != dtype:
        bucket.host_shard = torch.empty(bucket.hi - bucket.lo, dtype=dtype, pin_memory=True)
    return bucket.host, bucket.host_shard


def whole_grads(engine: Engine) -> bool:
    """After the reduction: every parameter's `.grad` the whole reduced gradient on every rank (what
    `synchronize()` promises at every stage), each bucket's slices allgathered into one gradient whose views the
    `.grad`s become: at stage 1 the bucket's own gradient memory (the local gradients it held), at stages 2 and
    3 (which hold none) memory allocated here, dropped with the `.grad`s at the next `zero()`. What the caller
    writes into them (clipping) is what the step applies: `grads_into_slices`. Returns whether it gathered (at
    stage 0 every `.grad` is the sum already). A collective."""
    for bucket in engine.buckets if engine.segments else ():
        full = bucket.flat if bucket.flat is not None else bucket.shard.new_empty(bucket.numel)
        if engine.comm.size == 1:
            full.copy_(bucket.shard)
        elif full.is_cuda and engine.staging:
            host, shard = staging(bucket, full.dtype)
            engine.gather(bucket, host, shard.copy_(bucket.shard))
            full.copy_(host)
            if bucket.unit is not None:
                bucket.unit.on_host = False  # the host memory no longer holds the unit's parameters
        else:
            engine.gather(bucket, full, bucket.shard)
        offset = 0
        for p in bucket.params:
            p.grad = full[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    return bool(engine.segments)


def grads_into_slices(engine: Engine) -> bool:
    """Before the step, after `whole_grads`: this rank's slices read back from the `.grad`s as the caller left
    them (zeros for a gradient it dropped). Returns False: the `.grad`s are read."""
    for seg in engine.segments:
        if seg.param.grad is None:
            seg.tensor.grad.zero_()
        else:
            seg.tensor.grad.copy_(seg.param.grad.reshape(-1)[seg.start:seg.stop])
    return False


def reduce_into_shard(engine: Engine, send: Any, bucket: Bucket) -> None:
    """Sum `send` (a bucket's whole gradient) over the ranks into this rank's slice `bucket.shard`, scaled and
    on the wire format, by the engine's reducer (stages 1 to 3)."""
    import torch

    e, out = engine, bucket.shard
    if e.comm.size == 1:
        out.copy_(send[bucket.lo:bucket.hi])
        if e.prescale * e.postscale != 1.0:
            out.mul_(e.prescale * e.postscale)
        return
    e.count_wire(send.numel(), send.element_size())  # the payload
    staged = send.is_cuda and e.staging
    if staged:
        host, out = staging(bucket, send.dtype)
        send = host[:send.numel()].copy_(send.reshape(-1)).view(send.shape)
        out = out.view(bucket.shard.shape) if out.dtype == bucket.shard.dtype else torch.empty(
            bucket.shard.shape, dtype=bucket.shard.dtype)
    scaled_sum(send, out, e.compress, e.prescale, e.postscale, e.comm.size,
               lambda s, o, op: e.colls.reduce_scatter(s, o, bucket.counts, op), load_mpi())
    if staged:
        bucket.shard.copy_(out)


def unpacked(engine: Engine, bucket: Bucket) -> bool:
    """Whether `bucket` is summed without packing it: by the allreduce reducer (each rank keeps its slice of
    the sum anyway), in host memory, not in rank order, and with a gradient large enough to be summed alone."""
    return (engine.reduce == "allreduce" and not engine.deterministic and engine.comm.size > 1
            and not (engine.device.type == "cuda" and engine.staging) and len(bucket.params) > 1
            and any(p.numel() * p.element_size() >= engine.OWN_BYTES for p in bucket.params))


def allreduce_into_shard(engine: Engine, bucket: Bucket, buffer: Any) -> None:
    """The allreduce reducer with no packed copy of the bucket: a large gradient is summed in its own memory
    (as stage 0 does), the small ones together in `buffer`, and this rank copies its slice of each sum into
    `bucket.shard`; the `.grad`s are dropped. The same collectives in the same order on every rank."""
    import torch

    e, MPI = engine, load_mpi()
    small, at = [], 0
    for p in bucket.params:
        if p.numel() * p.element_size() >= e.OWN_BYTES:
            grad = (p.grad.reshape(-1).contiguous() if p.grad is not None
                    else torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
            p.grad = None
            _sum_and_keep(e, grad, [(at, grad)], bucket, MPI)
        else:
            small.append((p, at))
        at += p.numel()
    if small:
        packed, parts, offset = buffer[:sum(p.numel() for p, _ in small)], [], 0
        for p, at in small:
            view = packed[offset:offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            p.grad = None
            parts.append((at, view))
            offset += p.numel()
        _sum_and_keep(e, packed, parts, bucket, MPI)


def _sum_and_keep(e: Engine, buf: Any, parts: list[tuple[int, Any]], bucket: Bucket, MPI: Any) -> None:
    """Sum `buf` over the ranks in place, then copy this rank's part of each (offset in the bucket, view of
    `buf`) into the shard."""
    e.count_wire(buf.numel(), buf.element_size())
    scaled_sum(buf, buf, e.compress, e.prescale, e.postscale, e.comm.size, e.colls.allreduce, MPI)
    for at, view in parts:
        lo, hi = max(bucket.lo, at), min(bucket.hi, at + view.numel())
        if lo < hi:
            bucket.shard[lo - bucket.lo:hi - bucket.lo].copy_(view[lo - at:hi - at])


class Sharded(Strategy):
    """What every ZeRO stage shares: gradients reduce-scattered into this rank's slices, which its optimizer
    steps (`ShardedOptimizer`) and a checkpoint holds rank by rank."""

    COLLECTIVE = "reduce-scatter"
    sharded = True

    @classmethod
    def refuse(cls, compress: str, hierarchical: bool, reduce: str, module: Any, alone: list[Any]) -> None:
        """The config's rules for a sharded stage (base/config.py, the one place they are written; here for the
        library API, which builds no TrainConfig): a reducer, and the gradient sums ZeRO cannot shard."""
        ZeroConfig(stage=cls.stage, reduce=reduce)
        refusal = zero_refusal(cls.stage, compress, hierarchical)
        if refusal is not None:
            raise refusal

    def grad_tensors(self) -> list[Any]:
        """This rank's reduced slices: all of the summed gradient it holds after `wait()`."""
        return [b.shard for b in self.engine.buckets]

    def owns(self, tensor: Any) -> bool:
        return self.engine.owns(tensor)

    def reduced(self, param: Any) -> Any:
        """This rank's slice of `param`'s summed gradient (flat), for a parameter that is a bucket alone (given
        as `alone`)."""
        bucket = self.engine.bucket_of(param)
        if len(bucket.params) != 1:
            raise ValueError("GradSync.reduced: at ZeRO stages 1-3 the parameter shares its bucket; pass it as `alone`")
        return bucket.shard

    def optimizer(self, optimizer: Any) -> Any:
        """`optimizer` stepping only this rank's slices (the parameters are allgathered after its step)."""
        return ShardedOptimizer(optimizer, self.engine)


class ShardedState(Sharded):
    """The ZeRO stage 1 strategy of `engine` (a GradSync): gradients held as the allreduce holds them, each
    bucket reduce-scattered into this rank's slice, the optimizer state sharded."""

    stage = 1

    @classmethod
    def footprint(cls, cut: Cut) -> Footprint:
        """Whole parameters and gradients, and the reduced slice beside them; optimizer state for the slices."""
        return Footprint(params=cut.total, grads=cut.total + cut.owned, state=cut.owned, pieces=cut.owned_params)

    def build(self, ordered: list[Any], bucket_mb: float, alone: list[Any]) -> list[Bucket]:
        """Flat parameter memory for each bucket (its parameters become views into it), this rank's reduced
        gradient slice, and (`_hold_grads`) the stage's own gradient memory; each parameter of `alone` a bucket
        by itself."""
        e = self.engine
        buckets = []
        for index, group in enumerate(assign_buckets(ordered, bucket_mb, e.OWN_BYTES, alone)):
            bucket = sharded_bucket(index, group, e.comm.size, e.comm.rank, e.dtype, e.device)
            self._hold_grads(bucket, index, group)
            bucket.param_flat = flatten_params(bucket, e.dtype, e.device)
            bucket.owned = bucket.param_flat[bucket.lo:bucket.hi]
            buckets.append(bucket)
        return buckets

    def _hold_grads(self, bucket: Bucket, index: int, group: list[Any]) -> None:
        """Gradients as the allreduce holds them: a large one alone, small ones packed into a flat bucket."""
        e = self.engine
        owned = owned_bucket(index, group, e.dtype, e.device)
        bucket.flat, bucket.views, bucket.own = owned.flat, owned.views, owned.own

    # -- after backward --------------------------------------------------------------------------------
    def reduce(self, bucket: Bucket) -> None:
        bind_bucket(bucket)
        reduce_into_shard(self.engine, bucket.flat, bucket)

    # -- after the optimizer step (the "before forward" of stages 1 and 2) -------------------------------
    def after_step(self) -> None:
        """Every rank's updated slices to every rank: one in-place Allgather per bucket."""
        e = self.engine
        if e.comm.size == 1:
            return
        for bucket in e.buckets:
            flat = bucket.param_flat
            host = staging(bucket, flat.dtype)[0].copy_(flat) if flat.is_cuda and e.staging else flat
            e.gather(bucket, host)
            if host is not flat:
                flat.copy_(host)

    # -- what a step holds ---------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        """Bytes of gradient memory this rank holds now: the flat buckets and reduced slices."""
        buckets = self.engine.buckets
        held = sum(b.shard.numel() * b.shard.element_size() for b in buckets)
        held += sum(b.flat.numel() * b.flat.element_size() for b in buckets if b.flat is not None and not b.own)
        return held + sum(p.numel() * p.element_size() for b in buckets if b.own for p in b.params)


class ShardedGradients(ShardedState):
    """The ZeRO stage 2 strategy: as stage 1, but no gradient memory of its own; each bucket's gradients are
    packed and reduce-scattered as soon as backward has filled it, and dropped."""

    stage = 2
    eager = True  # free each bucket's gradients as soon as backward has filled it
    packs = True

    def __init__(self, engine: Engine, module: Any = None):
        super().__init__(engine, module)
        self._pack_buffer: Any = None  # the one buffer every bucket's gradients are packed into

    @classmethod
    def footprint(cls, cut: Cut) -> Footprint:
        """Whole parameters; of the gradients the reduced slice and the one buffer a bucket is packed into."""
        return Footprint(params=cut.total, grads=cut.owned + cut.packed, state=cut.owned, pieces=cut.owned_params)

    def _hold_grads(self, bucket: Bucket, index: int, group: list[Any]) -> None:
        """None: autograd's gradients live until their bucket is packed."""

    def reduce(self, bucket: Bucket) -> None:
        if unpacked(self.engine, bucket):
            allreduce_into_shard(self.engine, bucket, self.pack_buffer())
        else:
            reduce_into_shard(self.engine, pack(bucket, self.pack_buffer()), bucket)  # the packed copy is freed

    def pack_buffer(self) -> Any:
        """The one buffer a multi-parameter bucket's gradients are packed into (allocated on first use)."""
        import torch

        if self._pack_buffer is None:
            e = self.engine
            largest = max((b.numel for b in e.buckets if len(b.params) > 1), default=0)
            self._pack_buffer = torch.empty(largest, dtype=e.dtype, device=e.device)
        return self._pack_buffer

    def grad_bytes(self) -> int:
        """Bytes of gradient memory this rank holds now: reduced slices, any `.grad` not yet packed and the
        packing buffer."""
        buckets = self.engine.buckets
        held = sum(b.shard.numel() * b.shard.element_size() for b in buckets)
        if self._pack_buffer is not None:
            held += self._pack_buffer.numel() * self._pack_buffer.element_size()
        return held + sum(p.grad.numel() * p.grad.element_size() for b in buckets for p in b.params
                          if p.grad is not None)
