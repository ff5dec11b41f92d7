"""The honest limit of a training step, for `hpctrain bench train`: what a user would otherwise run.

Every rank computes, at the same time, the step a user writes in plain torch for the same model, optimizer
and batch (`optimizer.zero_grad(); loss.backward(); optimizer.step()`, the optimizer built with the kernel
`train` would build: fused where torch has one), with no hpctrain code in the loop and no communication;
where communication cannot overlap computation (`--overlap` off: one core per rank) one raw `Allreduce` of
all gradient bytes is added. hpctrain's step is judged against that sum, round by round, alternating with
it in the same launch.

That `Allreduce` is timed where a step has it (`InStepAllreduce`): in the same plain torch step, between
backward and the optimizer step, on one host buffer the step's fresh gradients were just copied into, after a
barrier (so no rank's wait for another is in it). Timed back to back instead, the same call on the same
buffer runs from what the previous one left in the caches, which no training step does (a step's fused SGD
alone streams several times the model's bytes between two allreduces), and reads much faster than the same
call in a step (docs/performance.md, "How to measure"). The back-to-back figure stays beside it (`raw_allreduce_ms`, and the
ratio against it, `step_over_limit_back_to_back`).

The figure this replaced, hpctrain's own step with each rank as its own world, is still reported as
`self_world_step_ms`: it holds hpctrain's per-step work (zeroing the buckets, hooks, accumulation into
bucket views), so a limit built on it hid exactly the overheads it should expose.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any, Callable

import numpy as np


def plain_torch_step(fresh_model: Callable[[], Any], xs: list[Any], ys: list[Any], *, optimizer: str, device: Any,
                     global_n: int, between: Callable[[list[Any]], Any] | None = None) -> Callable[[], None]:
    """A plain torch training step over the batches `xs`, `ys` (cycled), on a fresh copy of the model: the loss
    summed over this rank's targets and divided by the step's global target count, as `train` scales it;
    `between(params)`, when given, runs between backward and the optimizer step."""
    import torch

    from ..base.sections import OptimizerConfig
    from ..control.step import make_optimizer

    model = fresh_model().to(device)
    params = list(model.parameters())
    opt = make_optimizer(OptimizerConfig(name=optimizer, lr=0.01), model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    cuda = torch.device(device).type == "cuda"
    batches = itertools.cycle(list(zip(xs, ys)))

    def plain_torch() -> None:
        x, y = next(batches)
        opt.zero_grad()  # set_to_none, torch's default: autograd owns fresh gradients
        out = model(torch.from_numpy(x).to(device, non_blocking=True))
        target = torch.from_numpy(y).to(device, non_blocking=True)
        if out.dim() > 2:  # a language model's logits (batch, tokens, vocabulary): one target per token
            out, target = out.reshape(-1, out.shape[-1]), target.reshape(-1)
        (loss_fn(out, target) / global_n).backward()
        if between is not None:
            between(params)
        opt.step()
        if cuda:
            torch.cuda.synchronize()  # the step is done when its kernels are

    return plain_torch


def handwritten_step(fresh_model: Callable[[], Any], xs: list[Any], ys: list[Any], *, optimizer: str, device: Any,
                     global_n: int, comm: Any) -> Callable[[], None] | None:
    """The data-parallel loop a user writes by hand: the plain torch step with one raw in-place `Allreduce` of each
    gradient between backward and the optimizer step (last layers first, no buckets, no copies, no thread). It is
    not the limit: it also pays what synchronous steps cost, the ranks waiting for each other's slowest step every
    step, which the limit's sum of two separately timed medians leaves out. None on one rank or off the CPU."""
    if comm.size < 2 or str(device) != "cpu":
        return None
    step = plain_torch_step(fresh_model, xs, ys, optimizer=optimizer, device=device, global_n=global_n,
                            between=lambda params: [comm.allreduce_inplace(p.grad.numpy()) for p in reversed(params)
                                                    if p.grad is not None])
    return step


class InStepAllreduce:
    """The limit's communication, timed where a data-parallel step has it (see the module's docstring): called
    between a plain torch step's backward and its optimizer step, it copies the fresh gradients into one host
    float32 buffer (untimed: a packed bucket's copy is hpctrain's cost, not the limit's), waits at a barrier
    (untimed: the ranks' waits for each other are not the allreduce), then times one raw in-place `Allreduce`
    of the buffer."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.flat: np.ndarray | None = None
        self.seconds: list[float] = []  # this round's, on this rank
        self.rounds: list[float] = []  # per round, the slowest rank's median

    def __call__(self, params: list[Any]) -> None:
        import torch

        if self.flat is None:  # every parameter's bytes, as the back-to-back figure's (numpy too)
            self.flat = np.zeros(sum(p.numel() for p in params), np.float32)
        host, at = torch.from_numpy(self.flat), 0
        for p in params:  # a parameter without a gradient this step keeps its slot
            if p.grad is not None:
                host[at:at + p.numel()].copy_(p.grad.reshape(-1))
            at += p.numel()
        self.comm.barrier()
        t0 = time.perf_counter()
        self.comm.allreduce_inplace(self.flat)
        self.seconds.append(time.perf_counter() - t0)

    def end_round(self) -> None:
        """Keep the slowest rank's median over the allreduces since the last round (in `rounds`); collective."""
        mine = statistics.median(self.seconds) if self.seconds else 0.0
        self.seconds.clear()
        self.rounds.append(float(self.comm.allreduce_array([mine], op="max")[0]))


def limit_steps(fresh_model: Callable[[], Any], xs: list[Any], ys: list[Any], *, optimizer: str, device: Any,
                global_n: int, comm: Any, overlap: bool) -> tuple[dict[str, Callable[[], None] | None],
                                                                    InStepAllreduce | None]:
    """The steps hpctrain's is timed against, by name: the plain torch step (the limit's compute), the
    hand-written data-parallel loop, and the plain step that times the limit's allreduce where a step has it
    (None where there is none: one rank, or overlap hides communication); and that step's `InStepAllreduce`."""
    common = {"optimizer": optimizer, "device": device, "global_n": global_n}
    in_step = InStepAllreduce(comm) if comm.size > 1 and not overlap else None
    steps = {"plain": plain_torch_step(fresh_model, xs, ys, **common),
             "handwritten": handwritten_step(fresh_model, xs, ys, comm=comm, **common),
             "allreduce_in_step": (plain_torch_step(fresh_model, xs, ys, between=in_step, **common)
                                   if in_step is not None else None)}
    return steps, in_step


def limit_figures(hp_rounds: list[float], plain_rounds: list[float], in_step: InStepAllreduce | None,
                  raw_allreduce_ms: float | None, overlap: bool,
                  hand_rounds: list[float] | None = None) -> dict[str, Any]:
    """The limit and hpctrain's step against it, round by round (seconds in, milliseconds out): the median
    ratio, and its spread over the rounds. The limit of a round is its plain step plus, where overlap cannot
    hide it, its allreduce timed in the step (`in_step.rounds`); beside it, the ratio against the plain step
    plus the back-to-back `raw_allreduce_ms`. With `hand_rounds`, the hand-written loop beside both."""
    in_step_rounds = in_step.rounds if in_step is not None and not overlap else []
    comm = in_step_rounds or [0.0] * len(plain_rounds)
    limits = [plain + c for plain, c in zip(plain_rounds, comm)]
    ratios = [hp / limit for hp, limit in zip(hp_rounds, limits)]
    plain_ms, comm_ms = statistics.median(plain_rounds) * 1e3, statistics.median(comm) * 1e3
    out = {
        "plain_torch_step_ms": plain_ms,
        "limit_comm_ms": comm_ms,
        "limit_step_ms": plain_ms + comm_ms,
        "step_over_limit": statistics.median(ratios),
        "step_over_limit_rounds": ratios,
    }
    if in_step_rounds:
        out["raw_allreduce_in_step_ms"] = comm_ms
        out["raw_allreduce_in_step_rounds_ms"] = [s * 1e3 for s in in_step_rounds]
    if raw_allreduce_ms is not None:
        out["raw_allreduce_ms"] = raw_allreduce_ms
    if not overlap and raw_allreduce_ms is not None:
        out["step_over_limit_back_to_back"] = statistics.median(
            [hp * 1e3 / (plain * 1e3 + raw_allreduce_ms) for hp, plain in zip(hp_rounds, plain_rounds)])
    if hand_rounds:
        out["handwritten_step_ms"] = statistics.median(hand_rounds) * 1e3
        out["handwritten_over_limit"] = statistics.median([hand / limit for hand, limit in zip(hand_rounds, limits)])
        out["step_over_handwritten_rounds"] = [hp / hand for hp, hand in zip(hp_rounds, hand_rounds)]
        out["step_over_handwritten"] = statistics.median(out["step_over_handwritten_rounds"])
    return out
