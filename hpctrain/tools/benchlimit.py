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
                     global_n: int) -> Callable[[], None]:
    """A plain torch training step over the batches `xs`, `ys` (cycled), on a fresh copy of the model: the loss
    summed over this rank's targets and divided by the step's global target count, as `train` scales it."""
    import torch

    from ..base.config import TrainConfig
    from ..base.sections import OptimizerConfig
    from ..control.step import make_optimizer

    model = fresh_model().to(device)
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
        opt.step()
        if cuda:
            torch.cuda.synchronize()  # the step is done when its kernels are

    return plain_torch


def limit_figures(hp_rounds: list[float], plain_rounds: list[float], raw_allreduce_ms: float | None,
                  overlap: bool) -> dict[str, Any]:
    """The limit and hpctrain's step against it, round by round (seconds in, milliseconds out): the median
    ratio, and its spread over the rounds."""
    floor = 0.0 if overlap or raw_allreduce_ms is None else raw_allreduce_ms
    ratios = [hp * 1e3 / (plain * 1e3 + floor) for hp, plain in zip(hp_rounds, plain_rounds)]
    plain_ms = statistics.median(plain_rounds) * 1e3
    return {
        "plain_torch_step_ms": plain_ms,
        "limit_comm_ms": floor,
        "limit_step_ms": plain_ms + floor,
        "step_over_limit": statistics.median(ratios),
        "step_over_limit_rounds": ratios,
    }
