"""Under mpirun -n N: with uneven last batches, DistributedOptimizer applies the mean gradient over the
samples of each step, whichever order the loop zeroes in (zero_grad() first, or step(); zero_grad())."""

import sys

import torch

import hpctrain

ctx = hpctrain.init()
data, order = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
hpctrain.broadcast_parameters(model)
loader = hpctrain.ShardLoader(data, batch_size=4, shuffle=False)
opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, loader=loader)
loss_fn = torch.nn.CrossEntropyLoss()
steps = 0
for x, y in loader:
    if order == "zero-first":
        opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.synchronize()
    # the definition: the mean-loss gradient over every sample of this step, on all ranks together
    xs = ctx.comm.allgather(x)
    ys = ctx.comm.allgather(y)
    want = torch.autograd.grad(loss_fn(model(torch.cat(xs)), torch.cat(ys)), list(model.parameters()))
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, atol=1e-6), (order, steps, [len(b) for b in ys], (p.grad - w).abs().max())
    opt.step()
    if order == "zero-last":
        opt.zero_grad()
    steps += 1
opt.close()
if ctx.rank == 0:
    print("UNEVEN OK", ctx.world_size, order, steps)
