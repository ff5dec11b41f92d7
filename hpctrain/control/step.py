"""One training step and one validation pass of a data-parallel model: the pieces `hpctrain train` and
the library API (`hpctrain.api`) share, and what a benchmark times.

The loss of a step is each rank's summed per-sample loss divided by the step's global sample count, so the
summed allreduce leaves the mean gradient over every sample of the step in each `.grad`, however uneven
the ranks' batches are.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from ..comm import Comm, GradSync, ShardedOptimizer, ZeroSync
from ..base.config import TrainConfig
from ..data.reader import ShardReader
from ..base.rankenv import RankEnv
from .watchdog import Watchdog


def param_sha256(model: Any) -> str:
    """sha256 over the model's state_dict tensors, in key order: equal on every rank when ranks are in sync."""
    import torch

    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        t = tensor.detach().cpu().contiguous().view(-1)
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def auto_overlap(env: RankEnv, device_type: str) -> bool:
    """Overlap communication with backward only where it pays: a GPU computes, or the rank owns a spare CPU.

    With one CPU per rank, the communication thread competes with backward for that CPU (and MPI polls
    while it waits): measured on the reference MLP, 2 ranks on 2 cores, overlap made steps slower.
    """
    return device_type == "cuda" or env.torch_threads() >= 2


def train_step(model: Any, sync: GradSync, optimizer: Any, loss_fn: Any, x: np.ndarray, y: np.ndarray,
               global_n: int, *, clip_grad: float = 0.0, device: Any = "cpu", accumulate: int = 1) -> float:
    """One data-parallel step; returns this rank's summed loss.

    The loss is this rank's sum of per-sample losses divided by the step's global sample count, so the
    summed allreduce leaves in every `.grad` the mean gradient over all samples of the step. A rank whose
    batch is empty still joins the allreduce (with zeros), so uneven data never hangs. With `accumulate`
    K > 1 the batch runs as K micro-batches and only the last one's backward starts the allreduce.
    """
    import torch

    sync.zero()
    loss_value = 0.0
    bounds = np.linspace(0, len(y), accumulate + 1).astype(int) if accumulate > 1 else (0, len(y))
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        sync.enabled = i == len(bounds) - 2
        if hi == lo:
            continue
        xt = torch.from_numpy(x[lo:hi]).to(device, non_blocking=True)
        if xt.dtype != torch.float32:
            xt = xt.float()
        yt = torch.from_numpy(y[lo:hi]).to(device, non_blocking=True)
        loss_sum = loss_fn(model(xt), yt)
        (loss_sum / global_n).backward()
        loss_value += float(loss_sum.detach())
    sync.enabled = True
    sync.wait()
    if clip_grad:
        clip = getattr(optimizer, "clip_grad_norm_", None)  # a sharded optimizer clips its slices
        if clip is not None:
            clip(clip_grad)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return loss_value


def lr_factor(schedule: str, total: int) -> Any:
    if schedule == "cosine":
        return lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / max(1, total)))
    if schedule == "step":
        return lambda s: 0.1 ** ((s >= total // 2) + (s >= (3 * total) // 4))
    return lambda s: 1.0


def make_optimizer(cfg: TrainConfig, params: Any) -> Any:
    import torch

    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def make_sync(cfg: TrainConfig, model: Any, comm: Comm, overlap: bool) -> tuple[GradSync, Any]:
    """The gradient sync and the optimizer of a run: an allreduce and a plain optimizer, or with --zero 1/2 a
    reduce-scatter and an optimizer that steps only this rank's slices (parameters become bucket views)."""
    optimizer = make_optimizer(cfg, model.parameters())
    if cfg.zero:
        sync = ZeroSync(model.parameters(), comm, stage=cfg.zero, bucket_mb=cfg.bucket_mb, overlap=overlap,
                        compress=cfg.grad_compression, deterministic=cfg.deterministic, reduce=cfg.zero_reduce)
        return sync, ShardedOptimizer(optimizer, sync)
    sync = GradSync(model.parameters(), comm, bucket_mb=cfg.bucket_mb, overlap=overlap, compress=cfg.grad_compression,
                    hierarchical=cfg.hierarchical, deterministic=cfg.deterministic)
    return sync, optimizer


def evaluate(model: Any, reader: ShardReader, comm: Comm, *, watchdog: Watchdog | None = None,
             step: int = 0) -> dict[str, float]:
    """Validation loss and accuracy over all ranks' validation shards. Only the final reduction is a wait
    on other ranks (watched); the pass itself, however long, is this rank's own work."""
    import torch

    model.eval()
    loss_sum = correct = n = 0.0
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            device = next(model.parameters()).device
            x = torch.from_numpy(batch.x).to(device).float()
            y = torch.from_numpy(batch.y).to(device)
            out = model(x)
            loss_sum += float(loss_fn(out, y))
            correct += float((out.argmax(1) == y).sum())
            n += len(y)
    model.train()
    if watchdog is not None:
        watchdog.phase("validation reduction", step)
    loss_sum, correct, n = comm.allreduce_array([loss_sum, correct, n])
    if watchdog is not None:
        watchdog.idle()
    return {"val_loss": loss_sum / max(n, 1.0), "val_accuracy": correct / max(n, 1.0)}
