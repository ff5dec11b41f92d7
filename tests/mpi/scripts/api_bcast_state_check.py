"""Under mpirun -n N: `broadcast_optimizer_state` gives every rank root's optimizer state.

- A plain torch optimizer that has state on root only (only root stepped) gets it on every rank, without a step.
- A DistributedOptimizer at zero=0, 1 and 2 (collective state: every rank must take part in gathering it): no
  hang, every rank ends with root's hyperparameters and the same gathered state as before, and training on
  from there gives zero=0's parameters.
"""

import torch

import hpctrain

ctx = hpctrain.init()
comm = ctx.comm


def same_state(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys() or len(a["param_groups"]) != len(b["param_groups"]):
        return False
    for index, saved in a["state"].items():
        for key, value in saved.items():
            other = b["state"][index][key]
            if not (torch.equal(value, other) if torch.is_tensor(value) else value == other):
                return False
    return all({k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
               for ga, gb in zip(a["param_groups"], b["param_groups"]))


def build(zero: int) -> tuple[torch.nn.Module, hpctrain.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    hpctrain.broadcast_parameters(model)
    base = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, hpctrain.DistributedOptimizer(base, model, zero=zero, bucket_mb=0.0005)


def train(model: torch.nn.Module, opt: hpctrain.DistributedOptimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 * seed + ctx.rank)
    for _ in range(steps):
        x, y = torch.randn(6, 9, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# 1. a plain optimizer whose non-root ranks have no state yet
torch.manual_seed(0)
plain = torch.nn.Linear(5, 3)
hpctrain.broadcast_parameters(plain)
plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
if ctx.rank == 0:
    plain(torch.randn(4, 5)).square().sum().backward()
    plain_opt.step()
    plain_opt.param_groups[0]["lr"] = 0.05
hpctrain.broadcast_optimizer_state(plain_opt)
states = comm.allgather(plain_opt.state_dict())
assert states[ctx.rank]["state"], f"rank {ctx.rank} got no optimizer state"
assert all(same_state(states[0], s) for s in states), "plain optimizer state differs between ranks"
assert plain_opt.param_groups[0]["lr"] == 0.05

# 2. a DistributedOptimizer at every stage
ref_model, ref_opt = build(0)
train(ref_model, ref_opt, 3, 1)
ref_opt.param_groups[0]["lr"] = 0.0123  # what root broadcasts; identical on every rank in the reference
train(ref_model, ref_opt, 2, 2)
ref_opt.close()
for zero in (0, 1, 2):
    model, opt = build(zero)
    train(model, opt, 3, 1)
    before = opt.state_dict()  # collective at zero=1/2: every rank's slices joined
    opt.param_groups[0]["lr"] = 0.0123 if ctx.rank == 0 else 0.5  # only root's value may survive
    # zero=2: the user's own torch optimizer, as given to the DistributedOptimizer (it holds this rank's slices)
    hpctrain.broadcast_optimizer_state(opt.wrapped if zero == 2 else opt)
    assert opt.param_groups[0]["lr"] == 0.0123, (zero, ctx.rank, opt.param_groups[0]["lr"])
    after = opt.state_dict()
    before["param_groups"][0]["lr"] = 0.0123
    assert same_state(before, after), (zero, "the broadcast changed the gathered state")
    assert all(same_state(after, s) for s in comm.allgather(after)), (zero, "ranks disagree on the state")
    train(model, opt, 2, 2)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert (a - b).abs().max() < 1e-6, (zero, float((a - b).abs().max()))
    assert hpctrain.ranks_in_sync(model)
    opt.close()
    print(f"rank {ctx.rank} zero {zero} ok", flush=True)
if ctx.rank == 0:
    print("BCAST STATE OK", ctx.world_size)
