"""The update that ends a step (fp16's loss scale, clipping, the optimizer step) is written once
(`control/update.py`) and used by the plain step and the split one; a step is called with its batch and a
`StepSetup` of what does not change from step to step."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import torch

from hpctrain.comm import GradSync, self_comm
from hpctrain.control.hybrid import Parallel
from hpctrain.control.precision import LossScaler
from hpctrain.control.step import train_step
from hpctrain.control.update import StepSetup

CONTROL = Path(__file__).resolve().parents[2] / "hpctrain" / "control"


def test_the_update_has_one_home() -> None:
    """Only `update.py` unscales fp16's gradients and steps the optimizer of a training step."""
    for pattern in (r"\.unscale\(", r"optimizer\.step\(\)"):
        users = sorted(p.name for p in CONTROL.glob("*.py") if re.search(pattern, p.read_text()))
        assert users == ["update.py"], (pattern, users)


def test_a_step_takes_its_batch_and_the_setup() -> None:
    assert list(inspect.signature(train_step).parameters) == ["setup", "x", "y", "global_n", "phases"]
    assert list(inspect.signature(Parallel.step).parameters) == ["self", "setup", "x", "y", "global_n", "step",
                                                                 "phases"]


def _setup(**kw) -> tuple[StepSetup, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sync = GradSync(model.parameters(), self_comm(), overlap=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return StepSetup(model=model, sync=sync, optimizer=opt, loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),
                     **kw), model


def test_the_plain_step_clips_and_skips_through_the_update() -> None:
    x = np.random.default_rng(0).standard_normal((8, 4), dtype=np.float32) * 100
    y = np.arange(8) % 3
    setup, model = _setup(clip_grad=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    train_step(setup, x, y, 8)
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert 0 < float(moved) <= 0.1 * 1e-3 * (1 + 1e-5)  # lr x the clipped norm
    setup.sync.close()

    scaler = LossScaler(scale=2.0**16)
    setup, model = _setup(scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    x[0, 0] = np.inf  # an inf in the gradients: the step is skipped and the scale backs off
    train_step(setup, x, y, 8)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert scaler.scale == 2.0**15
    setup.sync.close()
