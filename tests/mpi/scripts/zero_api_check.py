"""Under mpirun -n N: the library's DistributedOptimizer(zero=1|2|3) steps like zero=0 (Adam, clipped), and a
Checkpointer of a sharded run restores into another stage with the same optimizer state and model."""

import sys
import tempfile

import torch

import hpctrain
from hpctrain.base.errors import ConfigError

ctx = hpctrain.init()
run_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()


def build(zero: int) -> tuple[torch.nn.Module, hpctrain.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, zero=zero,
                                        bucket_mb=0.0005)
    return model, opt


def train(model: torch.nn.Module, opt: hpctrain.DistributedOptimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        x, y = torch.randn(6, 9, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()


plain, plain_opt = build(0)
train(plain, plain_opt, 5)
for zero in (1, 2, 3):
    model, opt = build(zero)
    train(model, opt, 5)
    weights = opt.model_state_dict(rank=None)  # at zero=3 gathered unit by unit (collective)
    for key, value in plain.state_dict().items():
        assert (value - weights[key]).abs().max() < 1e-6, (zero, key, (value - weights[key]).abs().max())
    assert hpctrain.ranks_in_sync(model)
    if zero == 3 and ctx.world_size > 1:  # between steps a parameter holds no bytes: its read must not crash
        w = model[0].weight  # (a view of released memory read out of bounds: a segfault before), nor compute on
        assert w.shape == (17, 9) and w.numel() == 153  # a placeholder (NaN): it is refused, naming it
        try:
            torch.isnan(w)
            raise AssertionError("a read of a released parameter at zero=3 was taken")
        except ConfigError as exc:
            assert "parameter '0.weight' of unit '0'" in str(exc) and "\n" not in str(exc), exc
        assert bool(torch.isnan(w.data).all())
        try:
            w.data.add_(1.0)
            raise AssertionError("a write into a released parameter at zero=3 was taken")
        except RuntimeError:
            pass
        train(model, opt, 1)  # and the next step gathers it as ever
        train(plain, plain_opt, 1)
        weights = opt.model_state_dict(rank=None)
        assert all((value - weights[key]).abs().max() < 1e-6 for key, value in plain.state_dict().items())
    if zero == 3:
        ck = hpctrain.Checkpointer(run_dir, every=0)
        ck.close(5, model, opt)
        whole = opt.state_dict()  # collective: every rank's slices joined
    opt.close()
for zero in (0, 1, 3):
    model, opt = build(zero)
    units = opt.sync.strategy.units if zero == 3 else []
    for unit in units:  # as a staged gather (a GPU, an MPI that is not CUDA-aware) leaves them: the parameters
        unit.on_host = True  # on the host, gathered again from there without a collective until they change
    assert hpctrain.Checkpointer(run_dir, every=0).restore(model, opt) == 5
    assert not any(unit.on_host for unit in units), "a restore left the parameters' host copies taken as current"
    got = opt.state_dict()
    for index, saved in whole["state"].items():
        for key, value in saved.items():
            assert torch.equal(got["state"][index][key], value), (zero, index, key)
    back = opt.model_state_dict(rank=None)
    assert all(torch.equal(back[key], value) for key, value in weights.items()), zero
    opt.close()
if ctx.rank == 0:
    print("ZERO API OK", ctx.world_size)
