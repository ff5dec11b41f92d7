"""The honest limit of a training step, for `hpctrain bench train`: what a user would otherwise run.

Every rank computes, at the same time, the step a user writes in plain torch for the same model, optimizer
and batch (`optimizer.zero_grad(); loss.backward(); optimizer.step()`, the optimizer built with the kernel
`train` would build: fused where torch has one), with no hpctrain code in the loop and no communication;
where communication cannot overlap computation (`--overlap` off: one core per rank) one raw `Allreduce` of
all gradient bytes is added. hpctrain's step is judged against that sum, round by round, alternating with
it in the same launch.

The figure this replaced, hpctrain's own step with each rank as its own world, is still reported as
`self_world_step_ms`: it holds hpctrain's per-step work (zeroing the buckets, hooks, accumulation into
bucket views), so a limit built on it hid exactly the overheads it should expose.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any, Callable


def plain_torch_step(fresh_model: Callable[[], Any], xs: list[Any], ys: list[Any], *, optimizer: str, device: Any,
                     global_n: int, between: Callable[[list[Any]], Any] | None = None) -> Callable[[], None]:
    """A plain torch training step over the batches `xs`, `ys` (cycled), on a fresh copy of the model: the loss
    summed over this rank's targets and divided by the step's global target count, as `train` scales it;
    `between(params)`, when given, runs between backward and the optimizer step."""
    import torch

    from ..base.config import TrainConfig
    from ..base.sections import OptimizerConfig
    from ..control.step import make_optimizer

    model = fresh_model().to(device)
    params = list(model.parameters())
    opt = make_optimizer(TrainConfig(data=".", run_dir=".", optimizer=optimizer, lr=0.01).section(OptimizerConfig),
                         model.parameters())
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


def limit_steps(fresh_model: Callable[[], Any], xs: list[Any], ys: list[Any], *, optimizer: str, device: Any,
                global_n: int, comm: Any) -> dict[str, Callable[[], None] | None]:
    """The steps hpctrain's is timed against, by name: the plain torch step (the limit's compute) and the
    hand-written data-parallel loop (None where there is none)."""
    common = {"optimizer": optimizer, "device": device, "global_n": global_n}
    return {"plain": plain_torch_step(fresh_model, xs, ys, **common),
            "handwritten": handwritten_step(fresh_model, xs, ys, comm=comm, **common)}


def limit_figures(hp_rounds: list[float], plain_rounds: list[float], raw_allreduce_ms: float | None,
                  overlap: bool, hand_rounds: list[float] | None = None) -> dict[str, Any]:
    """The limit and hpctrain's step against it, round by round (seconds in, milliseconds out): the median
    ratio, and its spread over the rounds; with `hand_rounds`, the hand-written loop beside both."""
    floor = 0.0 if overlap or raw_allreduce_ms is None else raw_allreduce_ms
    ratios = [hp * 1e3 / (plain * 1e3 + floor) for hp, plain in zip(hp_rounds, plain_rounds)]
    plain_ms = statistics.median(plain_rounds) * 1e3
    out = {
        "plain_torch_step_ms": plain_ms,
        "limit_comm_ms": floor,
        "limit_step_ms": plain_ms + floor,
        "step_over_limit": statistics.median(ratios),
        "step_over_limit_rounds": ratios,
    }
    if hand_rounds:
        out["handwritten_step_ms"] = statistics.median(hand_rounds) * 1e3
        out["handwritten_over_limit"] = statistics.median(
            [hand * 1e3 / (plain * 1e3 + floor) for hand, plain in zip(hand_rounds, plain_rounds)])
        out["step_over_handwritten_rounds"] = [hp / hand for hp, hand in zip(hp_rounds, hand_rounds)]
        out["step_over_handwritten"] = statistics.median(out["step_over_handwritten_rounds"])
    return out
