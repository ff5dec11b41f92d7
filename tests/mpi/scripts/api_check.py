"""Under mpirun -n N: DistributedOptimizer gives the mean gradient over ranks, with or without scale_loss."""

import torch

import hpctrain

ctx = hpctrain.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
hpctrain.broadcast_parameters(model)
opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True)
loss_fn = torch.nn.CrossEntropyLoss()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


expected = []
for r in range(ctx.world_size):
    model.zero_grad(set_to_none=False)
    x, y = batch(r)
    expected.append(torch.autograd.grad(loss_fn(model(x), y), list(model.parameters())))
mean = [sum(g[i] for g in expected) / ctx.world_size for i in range(len(expected[0]))]
for scaled in (False, True):
    opt.zero_grad()
    x, y = batch(ctx.rank)
    loss = loss_fn(model(x), y)
    (opt.scale_loss(loss) if scaled else loss).backward()
    opt.synchronize()
    for p, m in zip(model.parameters(), mean):
        assert torch.allclose(p.grad, m, atol=1e-6), (scaled, (p.grad - m).abs().max())
opt.step()
assert hpctrain.ranks_in_sync(model)
opt.close()
if ctx.rank == 0:
    print("API OK", ctx.world_size)
