"""Under mpirun -n N: ShardLoader(drop_empty=...) over uneven shards. Every rank hands out `len(loader)`
batches per epoch (one count for all ranks: anything else hangs the allreduce); with drop_empty=True none of
them is empty and `samples_dropped` counts what was left out. Each rank writes one JSON line per setting
to OUT/rank-R.jsonl.

argv: DATA BATCH_SIZE OUT
"""

import json
import sys
from pathlib import Path

import torch

import hpctrain

ctx = hpctrain.init()
data, batch_size, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
lines = []
for drop in (False, True):
    loader = hpctrain.ShardLoader(data, batch_size=batch_size, shuffle=True, seed=3, drop_empty=drop)
    torch.manual_seed(0)
    model = torch.nn.Linear(loader.shardset.x_shape[0], loader.shardset.num_classes)
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, loader=loader)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        sizes, finite = [], True
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)  # mean: NaN on an empty batch
            finite = finite and bool(torch.isfinite(loss))
            loss.backward()
            opt.step()
            sizes.append(len(y))
        epochs.append({"sizes": sizes, "finite": finite})
    assert hpctrain.ranks_in_sync(model), drop
    assert all(torch.isfinite(p).all() for p in model.parameters()), drop
    opt.close()
    lines.append(json.dumps({"rank": ctx.rank, "drop_empty": drop, "len": len(loader),
                             "samples_dropped": loader.samples_dropped, "epochs": epochs}))
(out / f"rank-{ctx.rank}.jsonl").write_text("\n".join(lines) + "\n")
