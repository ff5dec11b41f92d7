"""What a run split over ranks (--tp T, --pp P) adds to the data-parallel trainer.

`Parallel` is how this rank's run is split: plain data parallelism (the whole model on every rank; the data
group is the world) or a layout (D, T, P) with its groups, this rank's stage and its pipeline. The trainer
asks it for the data-parallel communicator (the readers read the shards of D ranks; the gradient sync,
ZeRO and every wire format run over it unchanged), for a step, for a validation pass and for the whole model
at the end; the same calls with plain data parallelism are the trainer's own.

A split step (`Parallel.step`): the batch (the rows of this replica, read by each of its ranks) runs as
micro-batches through the pipeline schedule; the gradient sync starts on the data-parallel group during each
stage's last backward, as with --accumulate; once it is done, the tied embedding/head's gradient is summed
between the first and the last stage; fp16's skip decision and the norm of --clip-grad are agreed over
the world (a tensor every tensor-parallel rank holds counts once, so does the tied one); then the optimizer
steps. Only the last stage's tensor rank 0 reports the loss and the samples (the others report none), so the
sums over the world that the metrics take count each sample once.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import HpctrainError
from ..base.sections import ParallelConfig
from ..comm import Comm
from ..comm.p2p import allreduce_
from ..parallel.groups import Groups, make_groups
from ..parallel.layout import Layout, check_layout
from ..parallel.pipeline import Pipeline
from ..parallel.stages import build_stage, model_limits, put, shares
from ..trace.spans import TRACER
from ..checkpoint.modelfile import ModelFile
from .precision import autocast
from .step import evaluate, param_sha256, train_step
from .update import StepSetup
from .watchdog import waiting


@dataclass(slots=True)
class Parallel:
    """How this rank's run is split (see the module docstring)."""

    layout: Layout
    world: Comm
    data: Comm  # the data-parallel group: the world when plain
    groups: Groups | None = None
    pipeline: Pipeline | None = None
    micro: int = 1  # micro-batches per --batch-size rows
    counted: set[int] = field(default_factory=set)  # ids of the parameters whose gradient this rank counts in a norm
    flops_per_token: float | None = None  # of the whole model (a stage cannot tell)

    @property
    def plain(self) -> bool:
        return self.groups is None

    @property
    def reporter(self) -> bool:
        """Whether this rank reports its replica's loss and samples."""
        return self.groups is None or self.groups.reporter

    def model(self, whole: Any) -> Any:
        """What this rank trains: the whole model (plain), or its stage."""
        return whole if self.pipeline is None else self.pipeline.stage

    def summary(self) -> dict[str, Any]:
        """summary.json's layout entries."""
        lay = self.layout
        return {"layout": {"data": lay.data, "tensor": lay.tensor, "pipe": lay.pipe}, "micro_batches": self.micro,
                **({"pipeline_schedule": self.pipeline.kind} if self.pipeline is not None else {})}

    def finish_state(self, model: Any, sync: Any, path: Path) -> tuple[ModelFile | None, str, bool]:
        """(rank 0's file of the whole model at `path`, for it to `close()`, else None; the model's sha256;
        whether the ranks agree), a collective of every rank. With ZeRO 3, `sync` gathers a plain run's model
        unit by unit, and rank 0 writes each tensor while it is gathered: no rank holds the whole model."""
        if self.pipeline is None:
            out = ModelFile(path, model.state_dict(keep_vars=True).items()) if self.world.rank == 0 else None
            digest, _ = param_sha256(model, sync, write=out.write if out is not None else None)
            return out, digest, len(set(self.world.allgather(digest))) == 1
        state = self.whole_state(model)
        digest, in_sync = self._digest_and_sync(model, state)
        if state is None:
            return None, digest, in_sync
        out = ModelFile(path, state.items())
        for key, tensor in state.items():
            out.write(key, tensor)
        return out, digest, in_sync

    @property
    def tied(self) -> list[Any]:
        return self.pipeline.stage.tied if self.pipeline is not None else []

    def step(self, setup: StepSetup, x: np.ndarray, y: np.ndarray, global_n: int, *, step: int = 0,
             phases: dict[str, float] | None = None) -> float:
        """One optimizer step of `setup` (see the module docstring); this rank's reported summed loss. The update
        (fp16's loss scale, clipping, the optimizer step) is `StepSetup.update`'s, as in the plain step."""
        if self.pipeline is None:
            return train_step(setup, x, y, global_n, phases=phases)
        sync = setup.sync
        sync.zero()
        scale = setup.loss_scale()
        bounds = np.linspace(0, len(y), self.micro * setup.accumulate + 1).astype(int).tolist()
        with sync.no_sync() as last_backward:  # the pipeline's last backward reduces
            loss = self.pipeline.step(x, y, bounds, scale / global_n, step=step, last_backward=last_backward)
        t0 = time.perf_counter()
        sync.wait()
        for param in self.tied:  # the embedding's gradient on the first stage plus the head's on the last
            allreduce_(self.groups.tie, sync.reduced(param), label="tied gradient sum")
        t1 = time.perf_counter()
        setup.update(self.world, lambda max_norm: self._clip(sync, setup.optimizer, max_norm))
        t2 = time.perf_counter()
        TRACER.span("wait", t0, t1)  # the data-parallel group's gradient sum (and the tied one's) still on the wire
        TRACER.span("optimizer", t1, t2)
        if phases is not None:
            timing = self.pipeline.timing
            for name, value in (("forward", timing.forward), ("backward", timing.backward),
                                ("pipeline_wait", timing.wait), ("wait", t1 - t0),
                                ("optimizer", t2 - t1), ("schedule", timing.wall)):
                phases[name] = phases.get(name, 0.0) + value
        return loss if self.reporter else 0.0

    def _clip(self, sync: Any, optimizer: Any, max_norm: float) -> None:
        """Clip the gradient norm of the whole model: each element counted once over the world, the partial
        sums of squares added in rank order (the same bits on every rank)."""
        segments = getattr(optimizer, "segments", None)
        if segments is not None:  # ZeRO: this rank's slices of its stage's gradients
            terms = [(s.param, s.tensor.grad) for s in segments]
        else:  # every data-parallel rank holds the same sums: the first counts them
            terms = [(p, p.grad) for p in self.pipeline.stage.parameters() if p.grad is not None]
            terms = terms if self.groups.d == 0 else []
        partial = sum(float(g.double().square().sum()) for p, g in terms if id(p) in self.counted)
        total = math.sqrt(sum(self.world.allgather(partial)))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in sync.grad_tensors():
                g.mul_(coef)

    def evaluate(self, model: Any, reader: Any, *, watchdog: Any = None, step: int = 0,
                 precision: str = "fp32", every_batch: bool = False) -> dict[str, float]:
        """Validation over every replica's validation shards (per token for a language model); `every_batch`:
        every rank runs a forward for every batch, empty ones too (ZeRO 3: a forward gathers, a collective)."""
        if self.pipeline is None:
            return evaluate(model, reader, self.world, watchdog=watchdog, step=step, precision=precision,
                            every_batch=every_batch)
        import torch

        stage, g = self.pipeline.stage, self.groups
        started = time.perf_counter()
        stage.eval()
        loss_sum = correct = n = 0.0
        for batch in reader.epoch(0):
            if not len(batch.y):
                continue
            out = self.pipeline.forward_only(batch.x, step=step)
            if g.last:
                with torch.no_grad():
                    y = torch.from_numpy(batch.y).to(self.pipeline.device)
                    loss = float(stage.loss(out, y))
                    hits = float((stage.predict(out) == y.reshape(-1)).sum())
                if g.reporter:
                    loss_sum, correct, n = loss_sum + loss, correct + hits, n + y.numel()
        stage.train()
        TRACER.span("validation", started, time.perf_counter())
        with waiting(watchdog, "validation reduction", step):
            loss_sum, correct, n = self.world.allreduce_array([loss_sum, correct, n])
        return {"val_loss": loss_sum / max(n, 1.0), "val_accuracy": correct / max(n, 1.0)}

    def whole_state(self, model: Any) -> dict[str, Any] | None:
        """A split run's whole model: its state_dict on world rank 0 (None elsewhere), gathered from the first
        replica's ranks (a collective of every rank)."""
        import torch

        stage, g = self.pipeline.stage, self.groups
        mine = [(full, pieces, t.detach().cpu()) for _, full, t, pieces, writes in shares(stage, g.t) if writes]
        parts = self.world.gather(mine if g.d == 0 else [], root=0)
        if parts is None:
            return None
        whole = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in stage.whole.items()}
        covered = dict.fromkeys(whole, 0)
        for part in parts:
            for full, pieces, tensor in part:
                put(whole[full], tensor, pieces)
                covered[full] += tensor.numel()
        short = [k for k, n in covered.items() if n != whole[k].numel()]
        if short:
            raise HpctrainError(f"the whole model lacks parts of {short[:3]} after gathering every stage's shares; "
                                "this is a bug, please report it")
        return {k: whole[stage.aliases.get(k, k)] for k in stage.keys}

    def _digest_and_sync(self, model: Any, state: dict[str, Any] | None) -> tuple[str, bool]:
        """The whole model's sha256 (param_sha256 of its state_dict, as a data-parallel run has it) and
        whether the ranks agree: every replica holds the same stage shares, and every tensor-parallel rank the
        same whole tensors (a collective of every rank)."""
        import torch

        g = self.groups
        own, whole = hashlib.sha256(), hashlib.sha256()
        for key, _, tensor, pieces, _ in shares(self.pipeline.stage, g.t):
            raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            own.update(key.encode() + raw)
            if not pieces:
                whole.update(key.encode() + raw)
        seen = self.world.allgather((g.t, g.p, own.hexdigest(), whole.hexdigest()))
        replicas = {(t, p): set() for t, p, _, _ in seen}
        wholes = {p: set() for _, p, _, _ in seen}
        for t, p, o, w in seen:
            replicas[(t, p)].add(o)
            wholes[p].add(w)
        in_sync = all(len(v) == 1 for v in [*replicas.values(), *wholes.values()])
        digest = param_sha256(_Holder(state))[0] if state is not None else None
        return self.world.bcast(digest), in_sync


class _Holder:
    """A state_dict where `param_sha256` wants a model."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        return self._state


def layout_for(par: ParallelConfig, world: int, model: Any, model_name: str, shardset: Any) -> Layout:
    """The run's layout on `world` ranks (start-up, every rank): plain data parallelism keeps its own check
    of the shard count; a split refuses what the world, the model or the shards cannot take (check_layout)."""
    if par.tp * par.pp == 1:
        shardset.check_world(world)
        return Layout(world)
    return check_layout(world, par.tp, par.pp, model_limits(model, model_name), shardset.num_shards)


def sample_row(shardset: Any) -> np.ndarray:
    """A row of zeros like the data's (a language model's token ids, or a sample's features)."""
    if shardset.task == "lm":
        return np.zeros(shardset.seq_len, np.int64)
    return np.zeros(shardset.x_shape, np.float32)


def split(par: ParallelConfig, world: Comm, layout: Layout, model: Any, *, device: Any, precision: str,
          batch_rows: int, row: np.ndarray, seed: int | None = None, watchdog: Any = None) -> Parallel:
    """This rank's part of the run in `layout` (a collective of every rank): the groups, and for a split model
    its stage (the whole `model`, the same on every rank, is cut here) and pipeline, whose boundary shapes
    are agreed now by one forward of `row` (a row like the data's: `sample_row`).

    With `seed`, the ranks of a tensor-parallel group take one random stream (dropout and the like), that of
    the group's first rank: their replicated activations must drop the same elements. (So do the heads of
    different ranks inside attention: alike masks, where Megatron-LM keeps a second stream for them.)"""
    if layout.plain:
        return Parallel(layout, world, world)
    groups = make_groups(world, layout)
    if seed is not None:
        import torch

        torch.manual_seed(seed * 1_000_003 + layout.rank(groups.d, 0, groups.p) + 1)
    error, stage = None, None
    try:
        stage = build_stage(model, groups)
    except HpctrainError as exc:
        error = exc
    world.agree(error)
    stage.to(device)
    pipeline = Pipeline(stage, groups, par.pipeline_schedule, device, lambda: autocast(device, precision), watchdog)
    pipeline.agree_shapes(row)
    micro = par.micro_batches or (min(4 * layout.pipe, batch_rows) if layout.pipe > 1 else 1)
    counted = {id(p) for key, _, p, pieces, writes in shares(stage, groups.t) if writes}
    return Parallel(layout, world, groups.data, groups, pipeline, micro, counted, _flops(model))


def _flops(model: Any) -> float:
    """Training FLOPs per token of the whole model: the built-in GPT's own count, 6 N for another model."""
    from ..compute.gpt import GPT, model_flops_per_token

    if isinstance(model, GPT):
        return float(model_flops_per_token(model))
    return 6.0 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
