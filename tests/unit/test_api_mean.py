"""The torch behaviour `DistributedOptimizer` builds on (`hpctrain.control.step.in_kernel_mean`): a fused CPU optimizer
given `grad_scale` divides each gradient by it as it reads it, steps exactly as on the divided gradient, and
writes the divided gradient back into `.grad`. A torch release that stopped writing it back would leave the
sum in `.grad` after step(): this fails first."""

from __future__ import annotations

import pytest
import torch

KINDS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_fused_cpu_kernel_divides_by_grad_scale_and_writes_the_mean_back(kind: str, world: int) -> None:
    torch.manual_seed(0)
    summed = torch.nn.Parameter(torch.randn(1000))
    divided = torch.nn.Parameter(summed.detach().clone())
    a, b = KINDS[kind]([summed]), KINDS[kind]([divided])
    assert getattr(a, "_step_supports_amp_scaling", False)
    for step in range(3):
        mean = torch.randn(1000)
        summed.grad, divided.grad = mean * world, mean.clone()
        a.grad_scale = torch.tensor(float(world))
        a.step()
        del a.grad_scale
        b.step()
        assert torch.allclose(summed.grad, mean, rtol=1e-6, atol=1e-7), (step, (summed.grad - mean).abs().max())
        assert torch.allclose(summed, divided, rtol=1e-6, atol=1e-6), (step, (summed - divided).abs().max())
