"""hvd.SyncBatchNorm against one BatchNorm over the whole global batch (outputs, input gradients, running stats),
and hvd.elastic: a run commits to HPCTRAIN_ELASTIC_DIR, the next run (a requeue) starts from that commit.
argv[1]: "first" or "second". Prints BN OK / ELASTIC OK per rank."""

import os
import sys

import torch

import hpctrain.horovod as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
phase = sys.argv[1]

if phase == "first":
    torch.manual_seed(0)
    full = torch.randn(8 * size, 3, 5, 5, requires_grad=True)
    sync, ref = hvd.SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    ref.load_state_dict(sync.state_dict())
    mine = full.detach()[rank * 8:(rank + 1) * 8].clone().requires_grad_()
    weights = torch.randn(8 * size, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    (sync(mine) * weights[rank * 8:(rank + 1) * 8]).sum().backward()
    out_ref = ref(full)
    (out_ref * weights).sum().backward()
    assert torch.allclose(sync(mine.detach()).detach(), ref(full.detach()).detach()[rank * 8:(rank + 1) * 8], atol=1e-5)
    assert torch.allclose(mine.grad, full.grad[rank * 8:(rank + 1) * 8], atol=1e-5), (mine.grad - full.grad[rank * 8:(rank + 1) * 8]).abs().max()
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-5) and torch.allclose(sync.running_mean, ref.running_mean, atol=1e-6)
    print(f"BN OK {rank}", flush=True)

model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, epoch=0)


@hvd.elastic.run
def train(state):
    start = state.epoch
    for epoch in range(start, start + 2):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        state.epoch = epoch + 1
        state.commit()
    return start


start = train(state)
assert start == (0 if phase == "first" else 2), (phase, start)
assert os.path.exists(os.path.join(os.environ["HPCTRAIN_ELASTIC_DIR"], "elastic_state.pt"))
print(f"ELASTIC OK {rank} {start} {state.epoch}", flush=True)
