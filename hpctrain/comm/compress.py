"""Gradient compression for slow networks: low rank (PowerSGD) and sparse (top-k), both with error feedback.

`GradSync` hands each bucket's flat gradient (this rank's contribution to the sum) to a compressor, which
sums it over the ranks in compressed form and writes the (approximate) sum back in place. What a rank's
compression leaves out is kept as its error and added to its next gradient (error feedback), so nothing is
lost for good, only late: the sum over ranks of the errors is exactly what the approximations missed.

- `PowerSGD` (Vogels, Karimireddy and Jaggi, NeurIPS 2019): every weight matrix M (n x m; a conv kernel is
  viewed as out x rest) whose rank-r factors are smaller than it is summed as P Q^T: P = M Q (Q from the
  previous step: warm start, the same on every rank), allreduce P, orthonormalize it, Q = M^T P, allreduce
  Q; the sum is P Q^T. A rank's error is M - P Q^T / W. Vectors (biases, norms) and matrices that would not
  shrink are summed as they are. Two small allreduces per bucket, plus one for the uncompressed rest.
- `TopK`: each rank sends the `fraction` of its gradient entries largest in magnitude, as (value, index)
  pairs, allgathered; every rank adds all ranks' pairs in rank order, so the sum is the same bits everywhere.
  A rank's error is what it did not send.

Both keep ranks bit-identical (every rank computes the same decompression from the same gathered data),
and their state (errors, PowerSGD's Q) is per rank: `state_dict()` goes into the checkpoint's per-rank part
for exact resume; a resume on another world size starts from empty errors (with a warning). `wire_bytes`
(returned by `reduce`, summed per step by GradSync) is the payload this rank contributes: for a plain
allreduce, the gradient's bytes.
"""

from __future__ import annotations

from typing import Any, Callable

from ..base.config import parse_grad_compression
from .wire import buffer_spec
from .world import Comm, load_mpi

def make(spec: str, comm: Comm) -> "PowerSGD | TopK | None":
    kind, arg = parse_grad_compression(spec)
    if kind == "powersgd":
        return PowerSGD(comm, int(arg))
    if kind == "topk":
        return TopK(comm, arg)
    return None


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback and warm start, bucket by bucket."""

    def __init__(self, comm: Comm, rank: int):
        self.comm, self.rank = comm, rank
        self.errors: dict[int, Any] = {}  # bucket -> this rank's error, flat like the bucket
        self.qs: dict[int, Any] = {}  # bucket -> the warm-start Qs of its matrices, flat

    def _plan(self, params: list[Any]) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
        """(matrices as (offset, n, m, r), the rest as (offset, size)) of a bucket's parameters."""
        matrices, rest, offset = [], [], 0
        for p in params:
            size = p.numel()
            if p.dim() >= 2:
                n, m = p.shape[0], size // p.shape[0]
                r = min(self.rank, n, m)
                if (n + m) * r < n * m:
                    matrices.append((offset, n, m, r))
                    offset += size
                    continue
            rest.append((offset, size))
            offset += size
        return matrices, rest

    def reduce(self, index: int, flat: Any, params: list[Any], total: Callable[[Any], None]) -> int:
        """Sum `flat` (this rank's part of bucket `index`) over the ranks, approximately, in place; `total`
        sums a buffer over the ranks in place (GradSync's: flat, hierarchical or in rank order). Returns
        the bytes this rank put on the wire."""
        import torch

        matrices, rest = self._plan(params)
        error = self.errors.get(index)
        if error is None:
            error = self.errors[index] = torch.zeros_like(flat)
        flat.add_(error)
        error.copy_(flat)  # M, kept to subtract the approximation from below
        if index not in self.qs:
            self.qs[index] = self._initial_q(index, matrices, flat)
        q_all = self.qs[index]
        views, qs, at = [], [], 0
        for offset, n, m, r in matrices:
            views.append(flat[offset:offset + n * m].view(n, m))
            qs.append(q_all[at:at + m * r].view(m, r))
            at += m * r
        p_all = torch.empty(sum(n * r for _, n, _, r in matrices), dtype=flat.dtype, device=flat.device)
        ps, at = [], 0
        for (_, n, _, r), M, Q in zip(matrices, views, qs):
            ps.append(p_all[at:at + n * r].view(n, r))
            torch.matmul(M, Q, out=ps[-1])
            at += n * r
        rest_flat = torch.cat([flat[o:o + s] for o, s in rest]) if rest else flat[:0]
        if p_all.numel():
            total(p_all)
        for P, M, Q in zip(ps, views, qs):
            P.copy_(torch.linalg.qr(P).Q)  # orthonormal columns: the same on every rank (same input)
            torch.matmul(M.t(), P, out=Q)
        if q_all.numel():
            total(q_all)  # Q summed: the warm start of the next step too
        if rest_flat.numel():
            total(rest_flat)
        for P, M, Q in zip(ps, views, qs):
            torch.matmul(P, Q.t(), out=M)  # the approximate sum, in place in the bucket
        for (o, s), part in zip(rest, rest_flat.split([s for _, s in rest])):
            flat[o:o + s].copy_(part)
        error.sub_(flat, alpha=1.0 / self.comm.size)  # M - approx / W: each rank's share of what the sum missed
        for o, s in rest:
            error[o:o + s].zero_()  # sent exactly: no error
        return (p_all.numel() + q_all.numel() + rest_flat.numel()) * flat.element_size()

    def _initial_q(self, index: int, matrices: list[tuple[int, int, int, int]], flat: Any) -> Any:
        """Random Qs from a seed fixed by the bucket: the same on every rank without a broadcast."""
        import torch

        gen = torch.Generator().manual_seed(1_000_003 + index)
        q = torch.randn(sum(m * r for _, _, m, r in matrices), generator=gen, dtype=torch.float32)
        return q.to(dtype=flat.dtype, device=flat.device)

    def state_dict(self) -> dict[str, Any]:
        return {"errors": dict(self.errors), "qs": dict(self.qs)}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        """Restore `state_dict()` onto `device` (that of the gradients; None: where the tensors are)."""
        self.errors = _on(state["errors"], device)
        self.qs = _on(state["qs"], device)


class TopK:
    """Top-`fraction` sparsification with error feedback, (value, index) pairs allgathered."""

    def __init__(self, comm: Comm, fraction: float):
        self.comm, self.fraction = comm, fraction
        self.errors: dict[int, Any] = {}

    def reduce(self, index: int, flat: Any, params: list[Any], total: Callable[[Any], None]) -> int:
        """As PowerSGD.reduce; the pairs are allgathered and added in rank order (no use for `total`)."""
        import torch

        MPI = load_mpi()
        error = self.errors.get(index)
        if error is None:
            error = self.errors[index] = torch.zeros_like(flat)
        flat.add_(error)
        k = max(1, int(self.fraction * flat.numel()))
        idx = torch.topk(flat.abs(), k, sorted=False).indices.to(torch.int32)
        vals = flat[idx.long()].clone()
        error.copy_(flat)
        error[idx.long()] = 0  # what this rank did not send waits for the next step
        W = self.comm.size
        all_vals = torch.empty(W * k, dtype=vals.dtype, device=vals.device)
        all_idx = torch.empty(W * k, dtype=torch.int32, device=vals.device)
        self.comm.mpi.Allgather(buffer_spec(vals, MPI), buffer_spec(all_vals, MPI))
        self.comm.mpi.Allgather(buffer_spec(idx, MPI), buffer_spec(all_idx, MPI))
        flat.zero_()
        for r in range(W):  # rank order: the same sum, bit for bit, on every rank
            flat.index_add_(0, all_idx[r * k:(r + 1) * k].long(), all_vals[r * k:(r + 1) * k])
        return k * (vals.element_size() + idx.element_size())

    def state_dict(self) -> dict[str, Any]:
        return {"errors": dict(self.errors)}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        """Restore `state_dict()` onto `device` (that of the gradients; None: where the tensors are)."""
        self.errors = _on(state["errors"], device)


def _on(tensors: dict[Any, Any], device: Any) -> dict[int, Any]:
    """Copies of a checkpoint's per-bucket tensors on `device` (never aliasing the loaded state)."""
    return {int(k): (v.to(device, copy=True) if device is not None else v.clone()) for k, v in tensors.items()}

