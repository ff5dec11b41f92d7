"""Stage 0 of the gradient engine: every rank sums every bucket (an allreduce) and keeps the whole gradient.

After backward, each bucket is summed in place: a large gradient in the memory autograd handed over, small
ones in the flat buffer they were copied into (`buckets.bind_bucket`), on the wire as they are or in 16 bits
(`wire.scaled_sum`), or through a compressor (PowerSGD, top-k) with error feedback. Nothing happens before
forward: every rank holds every parameter.
"""

from __future__ import annotations

from typing import Any

from .buckets import Bucket, Strategy, assign_buckets, bind_bucket, owned_bucket
from .wire import scaled_sum, torch_dtype
from .world import load_mpi


class WholeGradients(Strategy):
    """The allreduce strategy of `engine` (a GradSync): without overlap, the buckets are summed in wait()."""

    def build(self, ordered: list[Any], bucket_mb: float, alone: list[Any]) -> list[Bucket]:
        """Buckets of at most `bucket_mb` MiB; a large gradient, and each parameter of `alone`, a bucket alone.
        Without overlap every bucket is summed in wait(), after backward: the small gradients are then packed
        together wherever they are in the model (one collective for a model's biases, not one between every
        two large layers), and the buckets are summed in forward order, the gradient backward wrote last
        (still in cache) first, which is slightly faster. A compressor keeps the runs of backward order (its state is
        per bucket)."""
        e = self.engine
        after_backward = not e.overlap and e.compressor is None
        groups = assign_buckets(ordered, bucket_mb, e.OWN_BYTES, alone, adjacent=not after_backward)
        if after_backward:
            groups.reverse()
        return [owned_bucket(i, group, e.dtype, e.device) for i, group in enumerate(groups)]

    # -- after backward --------------------------------------------------------------------------------
    def reduce(self, bucket: Bucket) -> None:
        """Sum `bucket`'s gradients over the ranks in place (its every gradient is ready, or gets none)."""
        import torch

        e = self.engine
        bind_bucket(bucket)
        flat = bucket.flat
        if e.comm.size == 1:  # a world of one: only the scaling is left to do
            if e.prescale * e.postscale != 1.0:
                flat.mul_(e.prescale * e.postscale)
            return
        if flat.is_cuda and e.staging:
            if bucket.host is None:
                bucket.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            bucket.host.copy_(flat, non_blocking=False)
            self._sum(bucket.host, bucket)
            flat.copy_(bucket.host, non_blocking=False)
        else:  # CUDA-aware or CPU: MPI reads the bucket itself (buffer_spec orders it after the stream's kernels)
            self._sum(flat, bucket)

    def _sum(self, flat: Any, bucket: Bucket) -> None:
        e = self.engine
        if e.compressor is not None:
            self._sum_compressed(flat, bucket)
            return
        e.count_wire(flat.numel(), flat.element_size())
        if e.compress != "none" and bucket.wire is None:
            import torch

            bucket.wire = torch.empty(flat.shape, dtype=torch_dtype(e.compress), device=flat.device)
        scaled_sum(flat, flat, e.compress, e.prescale, e.postscale, e.comm.size, e.colls.allreduce, load_mpi(),
                   bucket.wire)

    def _sum_compressed(self, flat: Any, bucket: Bucket) -> None:
        """Low rank or sparse, with error feedback. The compressor sees the gradient without the loss scale,
        so its state (errors, warm starts) stays in the gradient's own units when the scale changes; under a
        loss scale, a bucket that holds an inf or NaN on any rank (an fp16 overflow: the step will be skipped)
        leaves every rank's state untouched, and the bucket becomes NaN on every rank so that the scaler's
        check skips the step everywhere. Deciding that costs one 8-byte allreduce per bucket, only then."""
        e = self.engine
        MPI = load_mpi()
        scaled = e.loss_scale is not None
        if scaled and not self._finite_everywhere(flat):
            flat.fill_(float("nan"))
            return
        unscale = e.prescale / (e.loss_scale if scaled else 1.0)
        if unscale != 1.0:
            flat.mul_(unscale)
        e.wire_round += e.compressor.reduce(bucket.index, flat, bucket.params,
                                            lambda buf: e.colls.allreduce(buf, buf, MPI.SUM))
        rescale = e.postscale * (e.loss_scale if scaled else 1.0)
        if rescale != 1.0:
            flat.mul_(rescale)

    def _finite_everywhere(self, flat: Any) -> bool:
        """Whether no rank's part of this bucket holds an inf or NaN (the same answer on every rank)."""
        import torch

        bad = 0.0 if bool(torch.isfinite(flat).all()) else 1.0
        return self.engine.comm.allreduce_array([bad], op="max")[0] == 0.0

    # -- after the optimizer step ------------------------------------------------------------------------
    def after_step(self) -> None:
        """Nothing: every rank stepped the whole model."""

    # -- what a step holds -------------------------------------------------------------------------------
    def grad_tensors(self) -> list[Any]:
        """The memory that holds the summed gradients after `wait()` (to unscale or check them)."""
        return [b.flat for b in self.engine.buckets if b.flat is not None]

    def grad_bytes(self) -> int:
        """Bytes of gradient memory a step holds: the flat buckets, and the gradients reduced in place."""
        buckets = self.engine.buckets
        held = sum(b.flat.numel() * b.flat.element_size() for b in buckets if b.flat is not None and not b.own)
        return held + sum(p.numel() * p.element_size() for b in buckets if b.own for p in b.params)
