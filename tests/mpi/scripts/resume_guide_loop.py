"""The loop of docs/guides/library-api.md, as a user copies it, with what a resume test needs around it.

Arguments: DATA RUN_DIR EPOCHS EVERY STOP_AT; STOP_AT > 0 ends the loop after that step with the final
checkpoint (a run cut short). The last line is JSON: the step, the loader's epoch, the parameters' hash and the
samples this process's run trained on (all ranks together)."""

import json
import sys

import torch
from torch import nn

import hpctrain

data, run_dir, epochs, every, stop_at = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
ctx = hpctrain.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(ctx.device)
hpctrain.broadcast_parameters(model)
loader = hpctrain.ShardLoader(data, batch_size=32)
opt = hpctrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, loader=loader)
loss_fn = nn.CrossEntropyLoss(reduction="sum")
ck = hpctrain.Checkpointer(run_dir, every=every)
step = ck.restore(model, opt, loader)
samples = 0
while loader.epoch < epochs and not (stop_at and step >= stop_at):
    for x, y in loader:
        opt.zero_grad()
        (loss_fn(model(x), y) / max(1, len(y))).backward()
        opt.step()
        step += 1
        samples += len(y)
        if ck.step(step, model, opt, loader):
            raise SystemExit(3)
        if stop_at and step >= stop_at:
            break
ck.close(step, model, opt, loader)
total = ctx.comm.allreduce_array([samples])[0]
digest = hpctrain.param_hash(model)
if ctx.rank == 0:
    print(json.dumps({"step": step, "epoch": loader.epoch, "param_sha256": digest, "samples": int(total)}))
