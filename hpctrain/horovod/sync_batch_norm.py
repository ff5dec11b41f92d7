"""`hvd.SyncBatchNorm`: batch normalization whose statistics are those of the global batch over all ranks.

The per-rank sums (count, sum, sum of squares) are combined with one differentiable allreduce, so autograd's
backward carries the cross-rank terms (the allreduce's adjoint is an allreduce of the gradients).
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import allreduce
from .basics import size
from .handles import Sum


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Drop-in for `torch.nn.BatchNorm1d/2d/3d` in data-parallel training (Horovod's signature)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: Any) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Any) -> Any:
        self._check_input_dim(input)
        if not self.training or size() == 1:
            return super().forward(input)
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() // input.shape[1]], dtype=input.dtype, device=input.device)
        local = torch.cat([count, input.sum(dims), (input * input).sum(dims)])
        total = allreduce(local, op=Sum, name=None)
        n = total[0]
        mean = total[1:1 + self.num_features] / n
        var = total[1 + self.num_features:] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
        shape = [1, -1] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


__all__ = ["SyncBatchNorm"]
