"""Under mpirun -n N: DistributedOptimizer over a fused optimizer applies the mean gradient over the ranks with the
division inside the optimizer's kernel (no pass over the summed gradients), and `.grad` holds the mean after
step() and after synchronize() (which clip_grad_norm_ and a caller reading the gradients use), as with any other
optimizer. Three steps each, so the momentum and Adam's moments carry the division too."""

import copy

import torch

import hpctrain

ctx = hpctrain.init()
loss_fn = torch.nn.CrossEntropyLoss()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


KINDS = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, **kw),
}
for kind, make in KINDS.items():
    for fused in (True, False):
        for read_first in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
            reference = copy.deepcopy(model)
            opt = hpctrain.DistributedOptimizer(make(model.parameters(), fused=fused), model)
            ref_opt = make(reference.parameters(), fused=fused)
            in_kernel = opt._world_scale is not None
            assert in_kernel == (fused and ctx.world_size > 1), (kind, fused, in_kernel)
            for step in range(3):
                grads = []
                for r in range(ctx.world_size):  # every rank's gradient, computed here for the expected mean
                    x, y = batch(r, step)
                    grads.append(torch.autograd.grad(loss_fn(reference(x), y), list(reference.parameters())))
                mean = [sum(g[i] for g in grads) / ctx.world_size for i in range(len(grads[0]))]
                opt.zero_grad()
                x, y = batch(ctx.rank, step)
                loss_fn(model(x), y).backward()
                if read_first:
                    opt.synchronize()
                    for p, m in zip(model.parameters(), mean):
                        assert torch.allclose(p.grad, m, atol=1e-6), (kind, fused, step, (p.grad - m).abs().max())
                opt.step()
                for p, m in zip(model.parameters(), mean):
                    assert torch.allclose(p.grad, m, atol=1e-6), (kind, fused, read_first, step, (p.grad - m).abs().max())
                for p, m in zip(reference.parameters(), mean):
                    p.grad = m.clone()
                ref_opt.step()
                for p, q in zip(model.parameters(), reference.parameters()):
                    assert torch.allclose(p, q, atol=1e-6), (kind, fused, read_first, step, (p - q).abs().max())
            assert not hasattr(opt.wrapped, "grad_scale")  # the scale lives only for the step
            assert hpctrain.ranks_in_sync(model)
            opt.close()
if ctx.rank == 0:
    print("API MEAN OK", ctx.world_size)
