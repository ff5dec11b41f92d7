"""An `hpctrain.horovod` training script as a Horovod user writes it: hvd.elastic's TorchState committed every
EVERY steps to HPCTRAIN_ELASTIC_DIR, data drawn from the step number (so a restart from a commit sees the batches
an uninterrupted run sees). The Horovod API has no checkpointer of hpctrain's: what survives a stop is the last
commit.

Arguments: STEPS EVERY [PACE]: rank 0 sleeps PACE seconds a step, so that a signal lands mid-run. Each
step's batch is 8 samples per rank of a fixed random problem; every rank prints `pid RANK PID` first, rank 0
`step N` after every step (flushed, for a test to wait on) and, at the end, one JSON line: the step it started
from, the step it ended at and the parameters' hash."""

import json
import os
import sys
import time

import torch
from torch import nn

import hpctrain
import hpctrain.horovod as hvd

steps, every = int(sys.argv[1]), int(sys.argv[2])
pace = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
hvd.init()
print(f"pid {hvd.rank()} {os.getpid()}", flush=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> int:
    start = state.step
    while state.step < steps:
        g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        if state.step % every == 0:
            state.commit()
        if hvd.rank() == 0:
            print(f"step {state.step}", flush=True)
            time.sleep(pace)
    return start


start = train(state)
digest = hpctrain.param_hash(model)
if hvd.rank() == 0:
    print(json.dumps({"start": start, "step": state.step, "param_sha256": digest}), flush=True)
