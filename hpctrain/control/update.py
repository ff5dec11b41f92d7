"""The update that ends every training step, written once for the plain step (`step.train_step`) and the step of
a run split over the ranks (`hybrid.Parallel.step`): fp16's agreed loss scale, gradient clipping and the optimizer
step. `StepSetup` holds what a run's steps share, set once, so a step is called with its batch alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .precision import LossScaler


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSetup:
    """What does not change from one step of a run to the next."""

    model: Any
    """The model this rank steps: the whole model, or its stage of a split one."""
    sync: Any
    """The gradient sync (`comm.GradSync`) over the data-parallel ranks."""
    optimizer: Any
    """The optimizer it steps (a sharded one with ZeRO)."""
    loss_fn: Any = None
    """Summed per target (`reduction="sum"`); a pipeline stage computes its own."""
    device: Any = "cpu"
    """Where the batch is put."""
    clip_grad: float = 0.0
    """The largest norm of the whole model's gradient (0: not clipped)."""
    accumulate: int = 1
    """Micro-batches per step (--accumulate)."""
    precision: str = "fp32"
    """What forward and backward autocast to (--precision)."""
    scaler: LossScaler | None = None
    """fp16's loss scale, agreed over the ranks; None: no scaling."""

    def loss_scale(self) -> float:
        """This step's loss scale (1 without fp16), told to the gradient sync too: its sums carry it."""
        self.sync.set_loss_scale(self.scaler.scale if self.scaler is not None else None)
        return self.scaler.scale if self.scaler is not None else 1.0

    def update(self, comm: Any, clip: Callable[[float], None]) -> bool:
        """After the gradients are summed: unscale them (fp16; a step that any rank of `comm` finds inf or NaN in
        is skipped on every rank), clip their norm with `clip(max_norm)` (the whole model's norm), and step the
        optimizer. Returns whether it stepped."""
        if self.scaler is not None and not self.scaler.unscale(self.sync.grad_tensors(), comm):
            return False
        if self.clip_grad:
            clip(self.clip_grad)
        self.optimizer.step()
        return True
