"""Under mpirun -n 2: fp16's loss scale skips a step on every rank when one rank's gradients hold an inf,
with the allreduce (stage 0) and with ZeRO stage 2, where the inf lands only in the slice one rank owns."""

import math

import torch

from hpctrain.comm import GradSync, ZeroSync, world
from hpctrain.control.precision import LossScaler

comm = world()
for make in (lambda p: GradSync([p], comm, overlap=False), lambda p: ZeroSync([p], comm, stage=2, overlap=False)):
    param = torch.nn.Parameter(torch.zeros(10))
    sync = make(param)
    scaler = LossScaler(scale=1024.0, interval=2)
    results = []
    for step in range(3):
        sync.zero()
        grad = torch.ones(10)
        if step == 0 and comm.rank == 1:
            grad[0] = math.inf  # rank 1 alone overflows; after the sum, element 0 is in rank 0's slice
        (param * grad).sum().backward()
        sync.wait()
        results.append((scaler.unscale(sync.grad_tensors(), comm), scaler.scale))
    assert results == [(False, 512.0), (True, 512.0), (True, 1024.0)], (comm.rank, results)
    grads = torch.cat([g.reshape(-1) for g in sync.grad_tensors()])
    assert torch.allclose(grads, torch.full_like(grads, comm.size / 512.0)), grads  # unscaled by the scale used
    sync.close()
print("SCALER OK", comm.rank)
