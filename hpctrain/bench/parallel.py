"""`hpctrain bench train --tp T --pp P`: the step of a model split over the ranks, its pipeline bubble, where
each stage's time goes, and the memory each rank holds.

The step is `hpctrain train`'s own (`control.hybrid.Parallel.step`) on random rows (a replica's ranks draw the
same ones), timed as `bench train` times the data-parallel step: the slowest rank's median over rounds.
- Bubble: each stage's idle share of its pipeline schedule, from the schedule's own timestamps: 1 - (its
  forward and backward compute) / (the schedule's wall time), averaged over the measured steps and over the
  ranks of the stage; beside it the expected (P - 1) / (M + P - 1). Ranks that share cores (more ranks than
  cores) compute slower while their neighbours compute too, so there the measured bubble mixes the schedule
  with the contention: measure it with one core per rank, or with stages of fixed duration
  (benchmarks/paced_blocks.py, which sleeps instead of computing).
- Phases per stage (ms per step, the slowest rank of the stage): forward, backward, waits for a neighbour's
  transfer, the gradient sync after the schedule (the data-parallel sum, and the tied embedding/head's sum
  between the first and the last stage, which waits for the first stage's last backward), the optimizer.
- Memory per rank: parameters and optimizer state (after two steps, so the state exists), the largest over
  the ranks, and its ratio to the same for the whole model with its optimizer on one rank (measured on a
  whole copy stepped once here, before the split).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from ..base.sections import CommConfig, ParallelConfig, ZeroConfig
from ..comm import Comm
from .train import median_time, workload
from .watch import progress


def _state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of parameters and optimizer state a model and its optimizer hold."""
    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    opt = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else sum(
        v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values() if hasattr(v, "numel"))
    return params + opt


def _whole_bytes(model: Any, optimizer_name: str) -> int:
    """Parameters and optimizer state of the whole model with its optimizer, stepped once on zero gradients
    (so that the state exists): what one rank of plain data parallelism holds."""
    import torch

    from ..base.sections import OptimizerConfig
    from ..control.step import make_optimizer

    opt = make_optimizer(OptimizerConfig(name=optimizer_name, lr=0.01), model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    size = _state_bytes(model, opt)
    for p in model.parameters():
        p.grad = None
    opt.state.clear()
    return size


def bench_parallel(comm: Comm, *, model_spec: str, parallel: ParallelConfig, wire: CommConfig | None = None,
                   sharding: ZeroConfig | None = None, optimizer: str = "sgd", batch_size: int = 16, steps: int = 10,
                   rounds: int = 3, input_dim: int = 784, classes: int = 10, seq_len: int = 128,
                   vocab: int = 257) -> dict[str, Any]:
    """The measurements of the module docstring, on every rank of `comm` split as (W / (tp pp), tp, pp) by
    `parallel`, the gradients summed as `wire` and `sharding` say (train's sections; default: train's)."""
    import torch

    from ..base.config import check_across
    from ..base.rankenv import read_env
    from ..base.sections import OptimizerConfig
    from ..control import hybrid
    from ..control.step import auto_overlap, make_sync
    from ..control.update import StepSetup
    from ..parallel.layout import check_layout
    from ..parallel.pipeline import expected_bubble
    from ..parallel.stages import model_limits

    env = read_env()
    torch.set_num_threads(env.torch_threads())
    wire, sharding = wire or CommConfig(), sharding or ZeroConfig()
    check_across(sharding, wire, parallel, rows=batch_size, staged=False)
    probe, _, _ = workload(0, model_spec, 1, input_dim, classes, seq_len, vocab)
    model = probe()
    layout = check_layout(comm.size, parallel.tp, parallel.pp, model_limits(model, model_spec))
    d = layout.coords(comm.rank)[0]
    progress("the whole model's memory")
    whole = _whole_bytes(model, optimizer)
    _, xs, ys = workload(d, model_spec, batch_size, input_dim, classes, seq_len, vocab)  # a replica's rows
    progress("splitting the model")
    par = hybrid.split(parallel, comm, layout, model, device="cpu", precision="fp32",
                       batch_rows=batch_size, row=xs[0][0])
    stage = par.model(model)
    del model
    sync, opt = make_sync(wire, sharding, OptimizerConfig(name=optimizer, lr=0.01), stage,
                          par.data, wire.overlap if wire.overlap is not None else auto_overlap("cpu"), alone=par.tied)
    setup = StepSetup(model=stage, sync=sync, optimizer=opt, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"))
    targets = ys[0].size * layout.data
    phases: dict[str, float] = {}
    idle: list[float] = []
    state = {"i": 0}

    def step(record: bool = False) -> None:
        i = state["i"] = (state["i"] + 1) % len(xs)
        par.step(setup, xs[i], ys[i], targets, phases=phases if record else None)
        if record and par.pipeline is not None:
            t = par.pipeline.timing
            idle.append(1.0 - t.busy / t.wall if t.wall else 0.0)

    for _ in range(2):
        step()
    memory = _state_bytes(stage, opt)
    times = [median_time(comm, step, steps, warmup=1) for _ in range(rounds)]
    progress("the phases and the bubble")
    for _ in range(steps):
        step(record=True)
    sync.close()
    result = {"world_size": comm.size, "model": model_spec, "batch_size": batch_size,
              "layout": {"data": layout.data, "tensor": layout.tensor, "pipe": layout.pipe},
              "micro_batches": par.micro, "pipeline_schedule": parallel.pipeline_schedule,
              "optimizer": optimizer, "zero": sharding.stage,
              "torch_threads": torch.get_num_threads(), "step_ms": statistics.median(times) * 1e3,
              "step_ms_rounds": [t * 1e3 for t in times],
              "samples_per_s": batch_size * layout.data / statistics.median(times),
              "expected_bubble": expected_bubble(layout.pipe, par.micro)}
    result.update(_per_stage(comm, par, phases, idle, steps))
    sizes = comm.allreduce_array([memory], op="max")
    result["memory"] = {"params_and_optimizer_mib": float(sizes[0]) / 2**20, "whole_mib": whole / 2**20,
                        "ratio_to_whole": float(sizes[0]) / whole}
    return result


def _per_stage(comm: Comm, par: Any, phases: dict[str, float], idle: list[float], steps: int) -> dict[str, Any]:
    """Each stage's phases (ms per step, its slowest rank) and bubble (its ranks' mean), and their means."""
    names = ("forward", "backward", "pipeline_wait", "wait", "optimizer", "schedule")
    p = par.groups.p if par.groups is not None else 0
    mine = (p, [phases.get(k, 0.0) / steps * 1e3 for k in names], float(np.mean(idle)) if idle else 0.0)
    seen = comm.allgather(mine)
    stages = []
    for q in sorted({s for s, _, _ in seen}):
        rows = [(v, b) for s, v, b in seen if s == q]
        worst = np.max([v for v, _ in rows], axis=0)
        stages.append({"stage": q, **{k: float(x) for k, x in zip(names, worst)},
                       "bubble": float(np.mean([b for _, b in rows]))})
    return {"stages": stages, "bubble": float(np.mean([s["bubble"] for s in stages]))}
