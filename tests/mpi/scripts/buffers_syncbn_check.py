"""Under mpirun -n N: `hpctrain.horovod.SyncBatchNorm` in a library-API loop (BatchNorm's statistics over the
global batch, summed over MPI) ends where one process training BatchNorm1d on the whole global batch does, at ZeRO
0 and 3, overlap off and on: torch.nn.SyncBatchNorm needs a torch.distributed process group, which hpctrain does
not start (without one it normalizes by each rank's own batch).
"""

import torch

import hpctrain
import hpctrain.horovod as hvd

ctx = hpctrain.init()
hvd.init()
cells = 0
for zero in (0, 3):
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 17), hvd.SyncBatchNorm(17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
        one = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.BatchNorm1d(17), torch.nn.Tanh(),
                                  torch.nn.Linear(17, 4))
        one.load_state_dict(model.state_dict())
        opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), model, zero=zero,
                                            overlap=overlap, bucket_mb=0.0005)
        one_opt = torch.optim.SGD(one.parameters(), lr=0.3)
        for step in range(4):
            batches = [torch.Generator().manual_seed(1000 * step + r) for r in range(ctx.world_size)]
            xs = [torch.randn(6, 9, generator=g) * (1 + r) for r, g in enumerate(batches)]
            ys = [torch.randint(0, 4, (6,), generator=g) for g in batches]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[ctx.rank]), ys[ctx.rank]).backward()
            opt.step()
            one_opt.zero_grad()
            torch.nn.functional.cross_entropy(one(torch.cat(xs)), torch.cat(ys)).backward()
            one_opt.step()
        assert hpctrain.ranks_in_sync(model)
        got = opt.model_state_dict(rank=None)
        gap = max(float((got[k].double() - v.double()).abs().max()) for k, v in one.state_dict().items())
        assert gap <= 1e-5, (zero, overlap, gap)
        opt.close()
        cells += 1
if ctx.rank == 0:
    print("SYNCBN OK", ctx.world_size, cells)
