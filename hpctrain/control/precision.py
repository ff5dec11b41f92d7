"""Mixed precision: autocast for forward and backward, and fp16's loss scale with a skip decision that every
rank agrees on.

The weights, the gradients and the optimizer state stay fp32 (autocast computes matmuls and the like in
bf16 or fp16 and keeps reductions in fp32). fp16 has too little range for small gradients, so the loss is
multiplied by a scale before backward and the summed gradients divided by it afterwards; when any rank finds
an inf or NaN in its gradients (with ZeRO, in the slice it owns), every rank skips the step and halves the
scale, and after `interval` good steps in a row the scale doubles (the policy of torch.amp.GradScaler, with
the check agreed over the ranks so that no rank steps while another skips). The scale is in checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..comm.wire import torch_dtype


def autocast(device: Any, precision: str) -> Any:
    """The autocast context of `precision` on `device` (nothing for fp32)."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch_dtype(precision))


class LossScaler:
    """fp16's dynamic loss scale. `scale` multiplies the loss; after the gradient sum, `unscale(grads, comm)`
    says whether to step (True) and divides the gradients by the scale, or halves the scale (False)."""

    def __init__(self, scale: float = 2.0**16, *, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.scale = scale
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.good = 0  # good steps since the scale last changed
        self.skipped = 0  # steps skipped in this run (for the log and summary)

    def unscale(self, grads: list[Any], comm: Any) -> bool:
        """Divide `grads` (the summed gradient memory this rank holds) by the scale, unless a rank found an
        inf or NaN: then every rank skips the step (one small allreduce decides) and the scale halves."""
        import torch

        bad = any(not bool(torch.isfinite(g).all()) for g in grads)
        if comm.allreduce_array([float(bad)], op="max")[0] > 0:
            self.scale *= self.backoff
            self.good = 0
            self.skipped += 1
            return False
        inverse = 1.0 / self.scale
        for g in grads:
            g.mul_(inverse)
        self.good += 1
        if self.good >= self.interval:
            self.scale *= self.growth
            self.good = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good = float(state["scale"]), int(state["good"])
