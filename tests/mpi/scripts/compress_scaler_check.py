"""Under mpirun -n 2: fp16's loss scale with PowerSGD and top-k. An overflow on one rank skips that step on every
rank and leaves the error feedback untouched, so training goes on; and the error feedback is kept without the
loss scale, so a run whose scale changes (an overflow halves it, good steps double it) sums the same gradients
as one that never scaled at all."""

import math

import torch

from hpctrain.comm import GradSync, world
from hpctrain.control.precision import LossScaler

comm = world()
torch.manual_seed(0)
grads = [torch.randn(6, 5) * (1 + comm.rank) for _ in range(6)]  # one gradient per step, per rank


def run(spec: str, scaler: LossScaler | None, overflow_at: int | None) -> list[tuple[bool, torch.Tensor | None]]:
    param = torch.nn.Parameter(torch.zeros(6, 5))
    sync = GradSync([param], comm, overlap=False, compress=spec)
    out = []
    for step, g in enumerate(grads):
        sync.zero()
        scale = scaler.scale if scaler is not None else 1.0
        sync.set_loss_scale(scale if scaler is not None else None)
        g = g * scale
        if step == overflow_at and comm.rank == 1:
            g[0, 0] = math.inf  # rank 1 alone overflows
        (param * g).sum().backward()
        sync.wait()
        ok = scaler.unscale(sync.grad_tensors(), comm) if scaler is not None else True
        out.append((ok, param.grad.clone() if ok else None))
    errors = sync.compressor.state_dict()["errors"]
    assert all(bool(torch.isfinite(e).all()) for e in errors.values()), (spec, comm.rank, errors)
    sync.close()
    return out


for spec in ("powersgd:1", "topk:0.2"):
    scaled = run(spec, LossScaler(scale=1024.0, interval=2), overflow_at=0)
    assert [ok for ok, _ in scaled] == [False] + [True] * (len(grads) - 1), (spec, comm.rank, scaled)
    # the same steps without a loss scale: step 0 skipped, as the overflow made the scaled run do
    grads_ref = grads
    grads = grads_ref[1:]
    plain = run(spec, None, overflow_at=None)
    grads = grads_ref
    for k, ((_, a), (_, b)) in enumerate(zip(scaled[1:], plain)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (spec, comm.rank, k, (a - b).abs().max())
print("COMPRESS SCALER OK", comm.rank)
