"""Under mpirun -n N: DistributedOptimizer over a fused optimizer applies the mean gradient over the ranks with the
division inside the optimizer's kernel (no pass over the summed gradients), at stage 0 and with ZeRO 1, 2 and 3;
`.grad` holds the mean after step() and after synchronize() (which clip_grad_norm_ and a caller reading the
gradients use), as with any other optimizer, and with ZeRO clip_grad_norm_() sees the mean's norm. Three steps
each, so the momentum and Adam's moments carry the division too."""

import copy
import itertools

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


def check(kind: str, fused: bool, read_first: bool, zero: int) -> None:
    case = (kind, fused, read_first, zero)
    make = KINDS[kind]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    opt = hpctrain.DistributedOptimizer(make(model.parameters(), fused=fused), model, zero=zero)
    ref_opt = make(reference.parameters(), fused=fused)
    in_kernel = opt._world_scale is not None
    assert in_kernel == (fused and ctx.world_size > 1), (case, in_kernel)
    for step in range(3):
        grads = []
        for r in range(ctx.world_size):  # every rank's gradient, computed here for the expected mean
            x, y = batch(r, step)
            grads.append(torch.autograd.grad(loss_fn(reference(x), y), list(reference.parameters())))
        mean = [sum(g[i] for g in grads) / ctx.world_size for i in range(len(grads[0]))]
        opt.zero_grad()
        x, y = batch(ctx.rank, step)
        loss_fn(model(x), y).backward()
        if read_first and zero:  # this rank holds slices of the sum: their global norm is the mean's
            norm = opt.clip_grad_norm_(1e9)
            want = float(torch.linalg.vector_norm(torch.cat([m.reshape(-1) for m in mean])))
            assert abs(norm - want) <= 1e-5 * want, (case, step, norm, want)
        elif read_first:
            opt.synchronize()
            for p, m in zip(model.parameters(), mean):
                assert torch.allclose(p.grad, m, atol=1e-6), (case, step, (p.grad - m).abs().max())
        opt.step()
        if not zero:
            for p, m in zip(model.parameters(), mean):
                assert torch.allclose(p.grad, m, atol=1e-6), (case, step, (p.grad - m).abs().max())
        for p, m in zip(reference.parameters(), mean):
            p.grad = m.clone()
        ref_opt.step()
        # at ZeRO 3 the parameters hold no bytes between steps: the model is read whole, gathered
        whole = opt.model_state_dict(rank=None)
        for (name, p), q in zip(whole.items(), reference.state_dict().values()):
            assert torch.allclose(p, q, atol=1e-6), (case, step, name, (p - q).abs().max())
    assert not hasattr(opt.wrapped, "grad_scale")  # the scale lives only for the step
    assert hpctrain.ranks_in_sync(model)
    opt.close()


for case in itertools.product(KINDS, (True, False), (False, True), (0, 1, 2, 3)):
    check(*case)
if ctx.rank == 0:
    print("API MEAN OK", ctx.world_size)
