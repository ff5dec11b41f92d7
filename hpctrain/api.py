"""hpctrain as a library: bring your own training loop.

The same comm, data and checkpoint layers that `hpctrain train` uses, behind a few names:

    import hpctrain

    ctx = hpctrain.init()                                   # MPI, rank, world size, this rank's device
    model = Net().to(ctx.device)
    hpctrain.broadcast_parameters(model)                    # rank 0's weights everywhere
    opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    loader = hpctrain.ShardLoader("data/", batch_size=32)  # this rank's shards, every sample once per epoch
    for epoch in range(10):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()                 # allreduce starts during backward
            opt.step()                                      # waits for it, then steps

`DistributedOptimizer.step()` applies the mean of the ranks' gradients (each rank's weighted by its share
of the step's samples when the loader says the batches are uneven). `Checkpointer` adds atomic
checkpoints, signal-driven stops and exact resume to such a loop. `Timeline` records every rank's steps over
a window into RUN/trace.json and names a straggler, as `hpctrain train --trace` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .checkpoint import manager as ckpt, resume, rng as rngstate, state as ckptstate
from .checkpoint.loader import open_checkpoint
from .control import runlog
from .control.step import in_kernel_mean, step_dividing
from .control.tracing import Timeline
from .comm import Comm, GradSync, ShardedOptimizer, sharded_owner, world
from .data import staging
from .data.position import Cursor, Position
from .data.reader import ShardReader
from .data.shardformat import load_manifest
from .base.hostmem import tune_unless_decided
from .base.rankenv import RankEnv, read_env, select_device
from .base.errors import CheckpointError, ConfigError, HpctrainError
from .base.stop import FLAG as STOP
from .trace.spans import TRACER

_CONTEXT: "Context | None" = None
_ENGINES: "weakref.WeakKeyDictionary[Any, weakref.ref[GradSync]]" = weakref.WeakKeyDictionary()  # model -> its engine


@dataclass(frozen=True, slots=True)
class Context:
    """Where this process runs: its rank, the world, its local rank on the node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: Any
    comm: Comm
    env: RankEnv


def init(*, threads: int | None = None) -> Context:
    """Tune host memory (`hpctrain.tune_host_memory`: rank 0 warns when it came too late), start MPI (one rank
    without a launcher), size torch's thread pool to the CPUs this rank owns and pick its device (one GPU per local
    rank when GPUs are visible, else the CPU). Safe to call twice."""
    global _CONTEXT
    if _CONTEXT is None:
        tune_unless_decided()
        env = read_env()
        comm = world()
        torch.set_num_threads(threads or env.torch_threads())
        device = torch.device(select_device(env, torch.cuda.device_count() if torch.cuda.is_available() else 0))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _CONTEXT = Context(comm.rank, comm.size, env.local_rank, device, comm, env)
    return _CONTEXT


def broadcast_parameters(model: Any, root: int = 0) -> None:
    """Copy `root`'s parameters and buffers to every rank, in place."""
    init().comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()), root=root)


def broadcast_optimizer_state(optimizer: Any, root: int = 0) -> None:
    """Give every rank `root`'s optimizer state and hyperparameters (e.g. after loading it on `root` only);
    a rank that has no state yet (no step taken) gets it as it is, without a step.

    A collective on every rank. With `DistributedOptimizer(..., zero=1|2)` the state is sharded: every rank
    takes part in gathering it, `root`'s gathered state is broadcast and each rank keeps its own slices of
    it. So with ZeRO, load a state on every rank (`load_state_dict` keeps this rank's slices), not on root
    only: a rank holds no other rank's slices to broadcast.
    """
    ctx = init()
    owner = _state_owner(optimizer)
    gathered = isinstance(owner, ShardedOptimizer)  # its state_dict() is itself a collective
    state = owner.state_dict() if gathered or ctx.rank == root else None
    owner.load_state_dict(ctx.comm.bcast(state, root=root))


def _sync_of(optimizer: Any) -> GradSync | None:
    """The gradient engine behind `optimizer` (a DistributedOptimizer, or a torch optimizer a ShardedOptimizer
    was given to), or None."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.sync
    owner = sharded_owner(optimizer)
    return owner.sync if owner is not None else None


def _state_owner(optimizer: Any) -> Any:
    """What holds `optimizer`'s whole state: a DistributedOptimizer's plain or sharded optimizer, the
    ShardedOptimizer a torch optimizer was given to (zero=1/2: the torch optimizer holds this rank's slices
    only), or `optimizer` itself."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.optimizer
    return sharded_owner(optimizer) or optimizer


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps any torch.optim optimizer with hpctrain's bucketed, overlapped gradient allreduce.

    Gradients stay autograd's own (a large one is reduced in its own memory, small ones packed into one
    buffer per bucket); each bucket's allreduce starts as soon as backward has produced all of its
    gradients. `step()` waits for what is still in flight and steps the wrapped optimizer; `zero_grad()`
    drops the gradients, as torch's does (`set_to_none=False`: zeros).
    `no_sync()` is for gradient accumulation: backward inside it only accumulates.

    `zero=1` shards the optimizer state over the ranks (each rank steps only the parameter slices it owns,
    then the parameters are allgathered); `zero=2` also shards the gradients (reduce-scattered, each bucket's
    full gradient freed once sent); `zero=3` also the parameters: each module's are gathered only for its
    forward and backward (so between steps a parameter holds no bytes, keeps its shape and refuses reads in one
    line: use `model_state_dict()`, a collective). Only elementwise torch optimizers (SGD, Adam, AdamW, ...) can
    be sharded; `clip_grad_norm_()` clips the global norm; `state_dict()` gathers the whole state (collective).

    It is a `torch.optim.Optimizer` (so torch's LR schedulers accept it) whose `param_groups` are the wrapped
    optimizer's own dicts, at every stage: a scheduler attached to either one, before or after wrapping,
    drives the steps. With zero=1/2 the wrapped optimizer's groups hold this rank's slices of the parameters.
    Optimizer hooks: register them on the wrapped optimizer, whose `step()` this one calls.
    """

    def __init__(self, optimizer: Any, model: Any, *, bucket_mb: float = 25.0, overlap: bool | None = None,
                 compress: str = "none", hierarchical: bool = False, deterministic: bool = False,
                 loader: "ShardLoader | None" = None, zero: int = 0, zero_reduce: str = "auto"):
        from .control.step import auto_overlap

        ctx = init()
        self.optimizer: Any = optimizer
        self.wrapped = optimizer
        self.loader = loader
        if overlap is None:
            overlap = auto_overlap(ctx.device.type if hasattr(ctx.device, "type") else "cpu")
        # The scaling of each step is fixed when its first gradient is ready, i.e. once the batch it belongs
        # to has been handed out, whether zero_grad() ran before backward or after the previous step().
        self.sync: GradSync = GradSync(model.parameters(), ctx.comm, stage=zero, module=model, bucket_mb=bucket_mb,
                                       overlap=overlap, compress=compress, hierarchical=hierarchical,
                                       deterministic=deterministic, reduce=zero_reduce, scales=self._scales)
        self.optimizer = self.sync.strategy.optimizer(optimizer)
        _ENGINES[model] = weakref.ref(self.sync)
        self.model = model
        self.world_size = ctx.world_size
        self._loss_scaled = False
        # The mean over the ranks: divided by the fused kernel as it reads each gradient, where it can (see
        # `control.step.in_kernel_mean`), else one pass over the summed gradients
        self._world_scale = in_kernel_mean(optimizer, compress=compress, world_size=ctx.world_size,
                                           on_cpu=all(p.device.type == "cpu" for p in model.parameters()))
        self._mean_pending = False  # this step's sum still waits for its division

    # torch.optim.Optimizer's attributes, read live: the wrapped optimizer's load_state_dict() replaces them
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.wrapped.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.wrapped.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state (with zero=1/2: this rank's slices only; `state_dict()` gathers all)."""
        return self.optimizer.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("a DistributedOptimizer cannot take a new param group (its parameters are bucketed for "
                          "the gradient sync): give every param group to the optimizer before wrapping it")

    def _weight(self) -> float:
        """This rank's share of the step's mean: 1 / world size, or its share of the samples of the batch
        the loader handed out last (the one being trained on)."""
        return self.loader.rank_weight() if self.loader is not None else 1.0 / self.world_size

    def _scales(self) -> tuple[float, float]:
        """(prescale, postscale) of this step's reduction: the mean over ranks costs one in-place pass over
        the gradients, inside the reduction, unless scale_loss() put it into the loss or the optimizer's fused
        kernel divides by the world size (then postscale 1 and the division pending for step() or synchronize())."""
        self._mean_pending = False
        if self._loss_scaled:
            return 1.0, 1.0
        if self.loader is not None:
            return self.loader.rank_weight(), 1.0
        if self._world_scale is not None:  # divided in the optimizer's kernel, or by synchronize()
            self._mean_pending = True
            return 1.0, 1.0
        return 1.0, 1.0 / self.world_size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients before the next backward (torch's default); `set_to_none=False` leaves zeros."""
        self.sync.zero()
        self._mean_pending = False
        if not set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)

    def scale_loss(self, loss: Any) -> Any:
        """`opt.scale_loss(loss).backward()` multiplies the loss by this rank's weight, so the summed gradients
        already are the mean and no pass over gradient memory is needed (what `hpctrain train` does). Call it
        before backward, in every step."""
        self._loss_scaled = True
        return loss * self._weight()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.sync.no_sync():
            yield

    def synchronize(self, whole: bool = True) -> None:
        """Finish the gradient sync: `.grad` then holds the mean at every ZeRO stage (not with whole=False: sliced)."""
        self.sync.wait()
        self._synced = True
        if self._mean_pending:  # the caller reads the gradients before the step: the mean in them now
            self._mean_pending = False
            torch._foreach_mul_(self.sync.grad_tensors(), 1.0 / self.world_size)  # ZeRO: this rank's slices
        if whole:
            self.sync.whole_grads()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Finish the gradient sync and clip the global gradient norm to `max_norm`; returns the norm."""
        if not getattr(self, "_synced", False):
            self.synchronize(whole=False)
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm)
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def step(self, closure: Any = None) -> Any:
        start = time.perf_counter()
        if not getattr(self, "_synced", False):
            self.sync.wait()
        self._synced = False
        self._loss_scaled = False  # the next step says again whether its loss carries the weight
        waited = time.perf_counter()
        if self._mean_pending:
            self._mean_pending = False
            out = step_dividing(self.optimizer.step, self.wrapped, self._world_scale, closure)
        else:
            out = self.optimizer.step(closure)
        TRACER.span("wait", start, waited)  # on a Timeline's recorded steps only
        TRACER.span("optimizer", waited, time.perf_counter())
        return out

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def model_state_dict(self, rank: int | None = 0) -> dict | None:
        """The model's whole state_dict, as CPU copies, on `rank` (None elsewhere; None: on every rank). A
        collective: with zero=3 the model is gathered unit by unit, so call it on every rank (`model.state_dict()`
        is refused then: the parameters hold no bytes); at zero=0-2 it is `model.state_dict()` copied."""
        from .control.step import param_sha256

        keep = rank is None or init().rank == rank
        return param_sha256(self.model, self.sync, keep=keep)[1]

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        self.sync.close()


class ShardLoader:
    """Batches of this rank's shards (written by `hpctrain shard`) as torch tensors on the rank's device.

    Every rank gets the same number of batches per epoch (`len(loader)`): any other count would hang the
    gradient allreduce. A rank with fewer samples gets a shorter last batch, never a duplicate. The order is a
    pure function of (seed, epoch, rank, world size); `state_dict()` / `load_state_dict()` carry the position
    inside an epoch for exact resume. `stage_to` (a node-local DIR, or auto) reads this rank's files from
    verified copies there, removed when the loader goes (unless `keep_staged`), as `hpctrain train
    --stage-to` does; `staged` says what was copied.

    Shards of uneven size can leave a rank with nothing at the last step(s) of an epoch. By default
    (`drop_empty=False`) that rank gets an empty batch there, so that every sample is trained on exactly once
    per epoch; the DistributedOptimizer gives it no share of that step's mean. But a loss with
    reduction="mean" over an empty batch is NaN (torch's built-in losses still give zero gradients, so the
    model stays finite; what you log or check does not): compute it as
    `loss_fn(out, y, reduction="sum") / max(1, len(y))` (the mean, and 0 for an empty batch), or pass
    `drop_empty=True`. That drops, on every rank alike, the trailing steps of each epoch in which some rank
    would have no sample (as torch's DistributedSampler(drop_last=True) does), so every batch handed out is
    non-empty; `len(loader)` is the shorter count, and `samples_dropped` says how many samples (all ranks
    together) each epoch leaves out (which ones changes from epoch to epoch when shuffling).
    """

    def __init__(self, data: str | Path, *, batch_size: int, split: str = "train", shuffle: bool = True,
                 seed: int = 0, drop_empty: bool = False, stage_to: str | None = None, keep_staged: bool = False):
        ctx = init()
        self.shardset = load_manifest(data)
        if split not in self.shardset.splits:
            raise ConfigError(f"split {split!r} not in {str(data)!r}: it has {', '.join(self.shardset.splits)}")
        self.staged = staging.Staged()
        if stage_to is not None:
            self.shardset, self.staged = self._stage(ctx, split, stage_to, keep_staged)
        self.reader = ShardReader(self.shardset, split, rank=ctx.rank, world=ctx.world_size, batch_size=batch_size,
                                  shuffle=shuffle, seed=seed)
        self.cursor = Cursor(self.reader, drop_empty=drop_empty)  # the position, as `hpctrain train` keeps it
        self.device = ctx.device
        self.rank = ctx.rank
        self.world = ctx.world_size
        self.drop_empty = drop_empty
        # every rank's sample count is in the manifest: all ranks agree on the steps without talking
        counts = [int(c) for c in self.reader.counts]
        if drop_empty and min(counts) == 0:
            raise ConfigError(f"drop_empty=True: rank {counts.index(0)} has no samples of split {split!r} in "
                              f"{str(data)!r}, so every step would be dropped: use fewer ranks, or drop_empty=False")
        self.steps_per_epoch = self.cursor.steps_of(self.reader)
        self.samples_dropped = sum(max(0, c - self.steps_per_epoch * batch_size) for c in counts)

    epoch = property(lambda self: self.cursor.epoch, doc="The epoch being handed out (or next, between epochs).")
    step = property(lambda self: self.cursor.step, doc="The batches of this epoch handed out (of its rest, after a "
                    "resume on another world size mid-epoch).")

    def __len__(self) -> int:
        """The steps of the current epoch (of its rest, after a resume on another world size mid-epoch)."""
        return self.cursor.steps

    def _stage(self, ctx: Context, split: str, stage_to: str, keep: bool) -> tuple[Any, staging.Staged]:
        error, plan = None, None
        try:  # one owner per job, data and split: two loaders never remove each other's copies
            owner = f"api:{ctx.env.job_id or os.getppid()}:{Path(self.shardset.root).resolve()}:{split}"
            plan = staging.plan(self.shardset, stage_to, ctx.env, ctx.rank, ctx.world_size, owner=owner, splits=(split,))
        except HpctrainError as exc:
            error = exc
        ctx.comm.agree(error)
        ctx.comm.agree(staging.space_error(plan, ctx.comm))
        return staging.stage(plan, self.shardset, ctx.comm, keep=keep,
                             on_exit=lambda fn, *args: weakref.finalize(self, fn, *args))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.cursor.move_to(Position(epoch))

    @property
    def position(self) -> Position:
        """Where the loader stands after the batches handed out (after an epoch's last: the next epoch's
        start): what a checkpoint holds of the data, as `hpctrain train` records it."""
        return self.cursor.position

    def rank_weight(self) -> float:
        """This rank's share of the samples of the step whose batch was handed out last (1 / world size
        when batches are even)."""
        cur = self.cursor
        reader, step = cur.current if cur.current is not None else (cur.reader, cur.step)
        sizes = reader.step_sizes(min(step, max(0, cur.steps_of(reader) - 1)))
        return float(sizes[self.rank]) / float(max(1, sizes.sum()))

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        batches = self.cursor.batches()  # each batch counted as handed out: a checkpoint resumes after it
        try:
            for batch in batches:
                x = torch.from_numpy(batch.x).to(self.device, non_blocking=True)
                if x.dtype != torch.float32:
                    x = x.float()
                yield x, torch.from_numpy(batch.y).to(self.device, non_blocking=True)
        finally:
            batches.close()

    def state_dict(self) -> dict[str, Any]:
        """The position (`position`, as a checkpoint's meta.json records it) and this world size."""
        return {**self.cursor.meta(self.world), "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`, on any world size (one of an earlier version: on its own)."""
        if "segments" in state:
            self.cursor.move_to(Position.from_meta(state, self.world, self.reader.batch_size))
            return
        if state.get("world_size", self.world) != self.world and state.get("step", 0):
            raise ConfigError(f"loader state from {state['world_size']} ranks mid-epoch; resume on that many ranks")
        self.cursor.move_to(Position(int(state["epoch"]), int(state["step"])))


class Checkpointer:
    """Atomic, verifiable checkpoints of a custom loop, stops on a stop signal (`asked_by`: who), exact resume.

        ck = hpctrain.Checkpointer("runs/x", every=100)
        step = ck.restore(model, opt, loader, scheduler=sched)    # 0 on a fresh start
        ...
            step += 1
            if ck.step(step, model, opt, loader, scheduler=sched):  # saves when due; True after a stop signal
                break
        ck.close(step, model, opt, loader, scheduler=sched)       # the final checkpoint

    `scheduler` (optional, any torch LR scheduler) is saved with the optimizer and restored, so a warm-up or
    a cosine schedule continues where it stopped instead of starting again at step 0.
    """

    def __init__(self, run_dir: str | Path, *, every: int | str = "auto", keep: int = 2):
        ctx = init()
        self.run_dir = Path(run_dir)
        self.manager = ckpt.CheckpointManager(self.run_dir, ctx.comm, every=every, keep=keep)
        self._installed = STOP.install()  # the stop signals set the flag (not in the main thread: left alone)
        self.asked_by: str | None = None  # after a stop: "user" (Ctrl-C, SIGINT) or "scheduler" (SIGTERM, SIGUSR2)

    def _state(self, step: int, model: Any, optimizer: Any, loader: ShardLoader | None,
               scheduler: Any = None) -> dict[str, Any]:
        world = init().world_size  # where the data stands, as `hpctrain train` records it:
        meta = {"world_size": world, "api": True, **(loader.cursor.meta(world) if loader is not None else {})}
        return ckptstate.capture(model, _state_owner(optimizer), _sync_of(optimizer), scheduler=scheduler,
                                 rank_state={"rng": rngstate.capture()}, meta=meta)

    def restore(self, model: Any, optimizer: Any, loader: ShardLoader | None = None, *, scheduler: Any = None) -> int:
        """Load the newest complete checkpoint of run_dir into model, optimizer (and loader, scheduler);
        return its step (0 when there is none). Each rank reads only what it holds (with zero=1-3, its
        slices). Rank 0 says on stderr that it resumed, and from where."""
        ctx = init()
        path = ckpt.latest(self.run_dir) if ctx.rank == 0 else None
        path = ctx.comm.bcast(str(path) if path else None)
        if path is None:
            return 0
        loaded = open_checkpoint(Path(path), ctx.comm, verified=True)  # rank 0's latest() checked it
        resume.refuse_misfit(loaded, resume.shapes_of(model), ctx.comm, ours="this model",
                             fix="restore it into the model it was written with, or give the new model a new run_dir")
        if scheduler is not None and loaded.train.get("scheduler") is None:
            raise CheckpointError(f"checkpoint {path!r} holds no LR scheduler state (it was saved without "
                                  "scheduler=), so the schedule would restart at step 0: restore without "
                                  "scheduler= and set the schedule's position yourself, or use a new run_dir")
        sync = _sync_of(optimizer)
        ckptstate.restore(loaded, model, _state_owner(optimizer), sync, scheduler=scheduler, warn=warnings.warn)
        meta = loaded.meta
        mine = resume.restore_own(loaded, ctx.comm, sync, same=meta["world_size"] == ctx.world_size,
                                  warn=lambda text: warnings.warn(text, stacklevel=3))
        if loader is not None and "epoch" in meta:  # on any world size: the epoch goes on where it stood
            loader.cursor.move_to(Position.from_meta(meta, ctx.world_size, loader.reader.batch_size))
        elif loader is not None and mine is not None and mine.get("loader") is not None:  # an earlier version's
            loader.load_state_dict(mine["loader"])
        loaded.reader.close()
        self.manager.last_saved = int(loaded.meta["step"])
        if ctx.rank == 0:
            print(resume.resumed_line(self.manager.last_saved, Path(path), meta, world=ctx.world_size, changes=[],
                                      global_batch=loader and loader.reader.batch_size * ctx.world_size),
                  file=sys.stderr, flush=True)
        return self.manager.last_saved

    def step(self, step: int, model: Any, optimizer: Any, loader: ShardLoader | None = None, *,
             scheduler: Any = None) -> bool:
        """Call at every step boundary on every rank; returns True when the loop must stop (a checkpoint of
        this step has been written, and `asked_by` and RUN/stopped.json say who asked)."""
        stopping = self.manager.save(step, lambda: self._state(step, model, optimizer, loader, scheduler),
                                     stop_requested=STOP.requested)
        self.asked_by = runlog.record_stop(init().comm, self.run_dir, step) if stopping else None
        return stopping

    def close(self, step: int, model: Any, optimizer: Any, loader: ShardLoader | None = None, *,
              scheduler: Any = None) -> None:
        """Write the final checkpoint and restore the signal handlers."""
        self.manager.save(step, lambda: self._state(step, model, optimizer, loader, scheduler), final=True)
        if self._installed:
            STOP.restore()


def param_hash(model: Any) -> str:
    """sha256 of the model's state: equal on every rank when they are in sync. With a DistributedOptimizer of
    zero=3 over `model` this is a collective (the model is gathered unit by unit)."""
    from .control.step import param_sha256

    ref = _ENGINES.get(model)
    return param_sha256(model, ref() if ref is not None else None)[0]


def ranks_in_sync(model: Any) -> bool:
    """True when every rank holds the same parameters (a collective)."""
    hashes = init().comm.allgather(param_hash(model))
    return len(set(hashes)) == 1


__all__ = ["Context", "init", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "ShardLoader", "Checkpointer", "Timeline", "param_hash", "ranks_in_sync"]
