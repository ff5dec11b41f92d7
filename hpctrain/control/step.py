"""One training step and one validation pass of a data-parallel model: the pieces `hpctrain train` and
the library API (`hpctrain.api`) share, and what a benchmark times.

The loss of a step is each rank's summed per-sample loss divided by the step's global sample count, so the
summed allreduce leaves the mean gradient over every sample of the step in each `.grad`, however uneven
the ranks' batches are.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import numpy as np

from ..comm import Comm, GradSync
from ..base.sections import CommConfig, OptimizerConfig, ZeroConfig
from ..data.reader import ShardReader
from ..trace.spans import TRACER
from ..checkpoint.modelfile import byte_chunks
from .precision import autocast
from .update import StepSetup
from .watchdog import Watchdog, waiting


def param_sha256(model: Any, sync: Any = None, keep: bool = False,
                 write: Any = None) -> tuple[str, dict[str, Any] | None]:
    """(sha256 over the model's state_dict tensors in key order, equal on every rank when ranks are in sync;
    with `keep`, the state_dict as CPU copies). At ZeRO stage 3 the model is gathered unit by unit through
    `sync` (collective: every rank calls this), never whole on a rank that does not `keep` it. `write(key,
    tensor)` gets each tensor while it is whole (a `ModelFile` writes it)."""
    digest = hashlib.sha256()
    kept: dict[str, Any] | None = {} if keep else None
    copies: dict[int, Any] = {}  # a tensor under two keys (tied weights) is kept once, as torch.save keeps it
    items = sync.state_items(model) if sync is not None else model.state_dict(keep_vars=True).items()
    for key, tensor in items:
        digest.update(key.encode())
        for chunk in byte_chunks(tensor.detach().contiguous()):
            digest.update(chunk)
        if write is not None:
            write(key, tensor)
        if kept is not None:
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
            kept[key] = copies[id(tensor)]
    return digest.hexdigest(), kept


def auto_overlap(device_type: str) -> bool:
    """Overlap communication with backward only where it pays: where a GPU computes.

    On CPUs the communication thread competes with torch's own threads for the rank's cores (and MPI polls
    while it waits), and every measurement made it slower, on 2 cores and on 16, at every ZeRO stage
    (docs/performance.md, the GPU machine's figures).
    """
    return device_type == "cuda"


def train_step(setup: StepSetup, x: np.ndarray, y: np.ndarray, global_n: int, *,
               phases: dict[str, float] | None = None) -> float:
    """One data-parallel step of `setup`'s model; returns this rank's summed loss.

    The loss is this rank's sum of per-target losses (one per sample; one per token of a token row) divided
    by the step's global target count `global_n`, so the summed allreduce leaves in every `.grad` the mean
    gradient over all targets of the step. A rank whose batch is empty still joins the allreduce (with
    zeros), so uneven data never hangs. With `accumulate` K > 1 the batch runs as K micro-batches and only
    the last one's backward starts the allreduce. `precision` autocasts forward and backward; the update
    (fp16's loss scale, clipping, the optimizer step) is `StepSetup.update`'s, as in a split run's step.
    `phases`, when given, accumulates seconds per phase: zero, forward, backward, hooks (inside backward),
    wait, optimizer (what `hpctrain bench train` breaks a step into).
    """
    import torch

    model, sync, loss_fn, device, precision = setup.model, setup.sync, setup.loss_fn, setup.device, setup.precision
    clock = _Clock(phases, sync)
    sync.zero()
    clock.lap("zero")
    loss_value = 0.0
    scale = setup.loss_scale()
    accumulate = setup.accumulate
    bounds = np.linspace(0, len(y), accumulate + 1).astype(int) if accumulate > 1 else (0, len(y))
    with sync.no_sync() as last_backward:  # only the last micro-batch's backward reduces
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            if i == len(bounds) - 2:
                last_backward()
            if hi == lo and not sync.strategy.gathers_in_forward:  # else a forward is a collective: every rank runs every one
                continue
            xt = torch.from_numpy(x[lo:hi]).to(device, non_blocking=True)
            if xt.dtype != torch.float32 and xt.dtype != torch.int64:  # int64: token ids
                xt = xt.float()
            yt = torch.from_numpy(y[lo:hi]).to(device, non_blocking=True)
            with autocast(device, precision):
                out = model(xt)
            if out.dim() > 2:  # a language model: logits (batch, tokens, vocabulary), one target per token
                out, yt = out.reshape(-1, out.shape[-1]), yt.reshape(-1)
            loss_sum = loss_fn(out.float(), yt)
            clock.lap("forward")
            (loss_sum * (scale / global_n)).backward()
            loss_value += float(loss_sum.detach())
            clock.lap("backward")
    sync.wait()
    clock.lap("wait")
    # a sharded optimizer clips its slices; otherwise torch clips the whole model, which every rank holds
    clip = getattr(setup.optimizer, "clip_grad_norm_", None) or (
        lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if setup.update(sync.comm, clip):  # not after an inf or NaN on some rank: every rank skips this step
        clock.lap("optimizer")
    clock.done()
    return loss_value


class _Clock:
    """Seconds per phase of a step, summed into `phases` (the time inside the gradient hooks taken out of
    backward and counted as `hooks`), and each phase a span of the timeline when it records this step;
    nothing at all when neither is asked for."""

    def __init__(self, phases: dict[str, float] | None, sync: GradSync):
        self.phases, self.sync, self.on = phases, sync, phases is not None or TRACER.active
        if self.on:
            self.hooks = sync.hook_seconds
            self.last = time.perf_counter()
            gathers = getattr(sync.strategy, "gather_seconds", None)  # ZeRO 3
            self.gathers = (gathers, sync.strategy.wait_seconds) if gathers is not None else None

    def done(self) -> None:
        """The step is over: ZeRO 3's gather time and the part of it forward and backward waited for."""
        if self.phases is not None and self.gathers is not None:
            strategy = self.sync.strategy
            for key, now, before in (("gathers", strategy.gather_seconds, self.gathers[0]),
                                     ("gather_wait", strategy.wait_seconds, self.gathers[1])):
                self.phases[key] = self.phases.get(key, 0.0) + now - before

    def lap(self, phase: str) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        if TRACER.active:
            TRACER.span(phase, self.last, now)
        if self.phases is not None:
            spent = now - self.last
            if phase == "backward":
                hooks, self.hooks = self.sync.hook_seconds - self.hooks, self.sync.hook_seconds
                self.phases["hooks"] = self.phases.get("hooks", 0.0) + hooks
                spent -= hooks
            self.phases[phase] = self.phases.get(phase, 0.0) + spent
        self.last = now


def in_kernel_mean(optimizer: Any, *, compress: str, world_size: int, on_cpu: bool) -> Any:
    """tensor(world size) where `optimizer`'s fused kernel can divide the summed gradients by it as it reads them
    (torch's `grad_scale`, the contract its GradScaler uses), else None: the library API's DistributedOptimizer then
    pays one pass over them after the sum.

    That pass costs a few percent of the reference MLP's step through the API at stage 0, against
    `scale_loss()`, which needs none (`hpctrain train` scales the loss): docs/performance.md. At every ZeRO stage (1-3 step the same fused optimizer
    over this rank's slices), with fp32 sums (a 16-bit wire or a compressor scales inside the sum), on the CPU
    (`on_cpu`: every parameter), where torch's fused SGD, Adam, AdamW and Adagrad write the divided gradient back
    (tests/unit/test_api_mean.py): after the step the gradients hold the mean, as after the pass."""
    import torch

    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if compress != "none" or world_size == 1 or not fused or not on_cpu:
        return None
    return torch.tensor(float(world_size))


def step_dividing(step: Any, kernel: Any, scale: Any, closure: Any = None) -> Any:
    """`step(closure)`, which steps the fused torch optimizer `kernel` (itself, or a ShardedOptimizer over it),
    with `scale` as `kernel`'s `grad_scale` (see `in_kernel_mean`): its kernel divides each gradient by it as it
    reads it, and writes the quotient back."""
    prior = getattr(kernel, "grad_scale", None)  # someone's own scale: both apply
    kernel.grad_scale = scale if prior is None else prior * scale
    try:
        return step(closure)
    finally:
        if prior is None:
            del kernel.grad_scale
        else:
            kernel.grad_scale = prior


def lr_factor(schedule: str, total: int, warmup: int = 0) -> Any:
    """The learning rate's factor at step s: the schedule's, times a linear warmup over the first `warmup` steps."""
    if schedule == "cosine":
        shape = lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / max(1, total)))  # noqa: E731
    elif schedule == "step":
        shape = lambda s: 0.1 ** ((s >= total // 2) + (s >= (3 * total) // 4))  # noqa: E731
    else:
        shape = lambda s: 1.0  # noqa: E731
    if warmup <= 0:
        return shape
    return lambda s: shape(s) * min(1.0, (s + 1) / warmup)


def make_optimizer(cfg: OptimizerConfig, params: Any) -> Any:
    """The optimizer of the optimizer section `cfg`, fused where torch has a fused kernel for the parameters (CPU and CUDA floats):
    one pass over the state instead of one per operation, several times faster than the loop of kernels."""
    import torch

    params = list(params)
    fused = {"fused": True} if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **fused)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)


def make_sync(wire: CommConfig, zero: ZeroConfig, opt: OptimizerConfig, model: Any, comm: Comm, overlap: bool, *,
              reduce: str | None = None, alone: Any = ()) -> tuple[GradSync, Any]:
    """The gradient sync and the optimizer of a run, from its communication, ZeRO and optimizer sections: an
    allreduce and a plain optimizer, or with --zero 1-3 a reduce-scatter and an optimizer that steps only this
    rank's slices (parameters become bucket views; at stage 3 gathered by module only while in use);
    `reduce` overrides --zero-reduce (a resume keeps the reducer its checkpoint was written with); each
    parameter of `alone` is a bucket by itself (a pipeline's tied embedding/head, whose reduced gradient is then
    summed between two stages)."""
    optimizer = make_optimizer(opt, model.parameters())
    sync = GradSync(model.parameters(), comm, stage=zero.stage, module=model, bucket_mb=wire.bucket_mb,
                    overlap=overlap, compress=wire.grad_compression, hierarchical=wire.hierarchical,
                    deterministic=wire.deterministic, reduce=reduce or zero.reduce, alone=alone)
    return sync, sync.strategy.optimizer(optimizer)


def evaluate(model: Any, reader: ShardReader, comm: Comm, *, watchdog: Watchdog | None = None,
             step: int = 0, precision: str = "fp32", every_batch: bool = False) -> dict[str, float]:
    """Validation loss and accuracy over all ranks' validation shards (per token for a language model).
    Only the final reduction is a wait on other ranks (watched); the pass itself, however long, is this
    rank's own work, but with `every_batch` (ZeRO 3: each forward gathers parameters, a collective) every rank
    runs a forward for every step of the pass, empty batches included."""
    import torch

    started = time.perf_counter()
    model.eval()
    loss_sum = correct = n = 0.0
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y) and not every_batch:
                continue
            device = next(model.parameters()).device
            x = torch.from_numpy(batch.x).to(device)
            x = x if x.dtype == torch.int64 else x.float()
            y = torch.from_numpy(batch.y).to(device)
            with autocast(device, precision):
                out = model(x)
            out, y = out.float().reshape(-1, out.shape[-1]), y.reshape(-1)
            loss_sum += float(loss_fn(out, y))
            correct += float((out.argmax(1) == y).sum())
            n += y.numel()
    model.train()
    TRACER.span("validation", started, time.perf_counter())
    with waiting(watchdog, "validation reduction", step):
        loss_sum, correct, n = comm.allreduce_array([loss_sum, correct, n])
    return {"val_loss": loss_sum / max(n, 1.0), "val_accuracy": correct / max(n, 1.0)}
