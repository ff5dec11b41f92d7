"""Under mpirun -n N: a model with BatchNorm (running statistics that each rank updates from its own batch) trained
through the library API at every ZeRO stage, overlap off and on. In each cell the ranks end holding the same
parameters and buffers, and a loop stopped after STOP steps and resumed (a fresh model and optimizer, as a new job
builds them) ends bit for bit where the uninterrupted loop does.

argv: RUN_DIR
"""

import sys
from pathlib import Path

import torch

import hpctrain

ctx = hpctrain.init()
root = Path(sys.argv[1])
STEPS, STOP = 6, 3


def build(seed: int, zero: int, overlap: bool) -> tuple[torch.nn.Module, hpctrain.DistributedOptimizer]:
    torch.manual_seed(seed)  # a resumed job's fresh weights differ: the checkpoint must bring them back
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.BatchNorm1d(17), torch.nn.Tanh(),
                                torch.nn.Linear(17, 4))
    hpctrain.broadcast_parameters(model)
    base = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    return model, hpctrain.DistributedOptimizer(base, model, zero=zero, overlap=overlap, bucket_mb=0.0005)


def train(model, opt, ck, step: int, until: int) -> int:
    while step < until:
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)  # each rank its own batch: its own statistics
        x, y = torch.randn(6, 9, generator=g) * (1 + ctx.rank), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if ck is not None:
            ck.step(step, model, opt)
    return step


cells = 0
for zero in (0, 1, 2, 3):
    for overlap in (False, True):
        cell = f"zero {zero} overlap {overlap}"
        model, opt = build(0, zero, overlap)
        train(model, opt, None, 0, STEPS)
        assert hpctrain.ranks_in_sync(model), cell
        want = hpctrain.param_hash(model)
        opt.close()

        run_dir = root / f"z{zero}-{int(overlap)}"
        model, opt = build(0, zero, overlap)
        ck = hpctrain.Checkpointer(run_dir, every=0)
        step = train(model, opt, ck, 0, STOP)
        ck.close(step, model, opt)
        opt.close()

        model, opt = build(1, zero, overlap)
        ck = hpctrain.Checkpointer(run_dir, every=0)
        step = ck.restore(model, opt)
        assert step == STOP, (cell, step)
        step = train(model, opt, ck, step, STEPS)
        ck.close(step, model, opt)
        got = hpctrain.param_hash(model)
        assert got == want, (ctx.rank, cell, got, want)
        assert hpctrain.ranks_in_sync(model), cell
        opt.close()
        cells += 1
if ctx.rank == 0:
    print("BUFFERS API OK", ctx.world_size, cells)
