"""Under mpirun -n 2: what ZeRO 3 holds during and between steps (the library's DistributedOptimizer, Adam).

- Between steps, no unit's gradient slice holds memory: each is held again by its unit's reduction, so that a
  unit's backward holds only the slices reduced before it.
- Before the backward of a unit too large for glibc to keep (its parameters and gradient are mapped afresh),
  the freed memory the process kept is handed back (malloc_trim), once per such unit and step; a smaller unit's
  backward hands back nothing (its memory is reused). Counted by wrapping the function zero3 calls.
- The model ends where zero=0 ends. Prints ZERO3 MEMORY OK per rank."""

import torch

import hpctrain
import hpctrain.comm.zero3 as zero3
from hpctrain.base.hostmem import MMAP_THRESHOLD

ctx = hpctrain.init()
assert ctx.world_size == 2, ctx.world_size
side = 3000  # one 3000x3000 float32 weight: 36 MB, above the 32 MiB glibc keeps
assert side * side * 4 > MMAP_THRESHOLD
trims = []
real = zero3.give_back_freed_memory
zero3.give_back_freed_memory = lambda: trims.append(1) or real()


def run(zero: int, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, side), torch.nn.Tanh(), torch.nn.Linear(side, side),
                                torch.nn.Tanh(), torch.nn.Linear(side, 4))
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, zero=zero)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        trims.clear()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if zero == 3:
            assert len(trims) == 1, f"step {step}: {len(trims)} hand-backs, not one (the one large unit's backward)"
            held = {b.index: b.shard.untyped_storage().nbytes() for b in opt.sync.buckets}
            assert not any(held.values()), f"step {step}: gradient slices hold memory between steps: {held}"
    return opt.model_state_dict(rank=None)


sharded, whole = run(3), run(0)
for key, value in whole.items():
    assert torch.allclose(sharded[key], value, rtol=0, atol=1e-6), (key, (sharded[key] - value).abs().max())
print(f"ZERO3 MEMORY OK {ctx.rank}", flush=True)
