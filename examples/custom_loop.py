"""A custom training loop on hpctrain's shards, with gradient accumulation, checkpoints and exact resume.

    hpctrain shard digits data/ --shards 2
    mpirun -n 2 python examples/custom_loop.py --data data/ --run-dir runs/loop [--accumulate 2] [--trace 10:30]

Every rank reads only its own shards (every sample once per epoch), the allreduce of each micro-batch
group starts during the last micro-batch's backward, a stop (Ctrl-C, SIGTERM, SIGUSR2) ends the loop at the next
step with a checkpoint and exit 3, and running the same command again resumes exactly where it stopped. With --trace, every rank's
steps of the window are recorded and merged into RUN/trace.json (open it in ui.perfetto.dev), and rank 0 says
whether a rank straggled.
"""

import argparse
import contextlib
import json

import torch
from torch import nn

import hpctrain

ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True)
ap.add_argument("--run-dir", required=True)
ap.add_argument("--epochs", type=int, default=10)
ap.add_argument("--batch-size", type=int, default=16)
ap.add_argument("--accumulate", type=int, default=2)
ap.add_argument("--trace", help="record every rank's steps of this window (A:B, last:N or every:N)")
args = ap.parse_args()

ctx = hpctrain.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(ctx.device)
hpctrain.broadcast_parameters(model)
loader = hpctrain.ShardLoader(args.data, batch_size=args.batch_size * args.accumulate, seed=1)
opt = hpctrain.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3), model, loader=loader)
loss_fn = nn.CrossEntropyLoss()
ck = hpctrain.Checkpointer(args.run_dir, every=50)
timeline = hpctrain.Timeline(args.run_dir, args.trace)  # records nothing without a window
step = ck.restore(model, opt, loader)  # says "resumed from step N (...)" when there was a checkpoint
if loader.epoch >= args.epochs and ctx.rank == 0:
    print(f"nothing left to do: the run in {args.run_dir} already trained its {args.epochs} epochs "
          f"(step {step}); raise --epochs to train on", flush=True)
first_loss = None
stopped = False
while loader.epoch < args.epochs and not stopped:
    epoch_loss, seen = 0.0, 0
    for x, y in loader:
        timeline.step(step + 1)
        opt.zero_grad()
        parts = [(xm, ym) for xm, ym in zip(x.chunk(args.accumulate), y.chunk(args.accumulate)) if len(ym)]
        for i, (xm, ym) in enumerate(parts):
            # only the last micro-batch's backward starts the allreduce
            with opt.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                with timeline.span("forward"):
                    loss = loss_fn(model(xm), ym) * len(ym) / len(y)
                with timeline.span("backward"):
                    loss.backward()
        opt.step()
        step += 1
        epoch_loss, seen = epoch_loss + loss.item(), seen + 1
        if ck.step(step, model, opt, loader):
            stopped = True
            break
    if ctx.rank == 0 and seen:
        first_loss = first_loss if first_loss is not None else epoch_loss / seen
        print(f"epoch {loader.epoch - 1 if not stopped else loader.epoch} step {step} loss {epoch_loss / seen:.4f}",
              flush=True)
if not stopped:
    ck.close(step, model, opt, loader)
traced = timeline.close()  # every rank; rank 0 merges RUN/trace.json
if traced and ctx.rank == 0:
    print(f"timeline: {args.run_dir}/trace.json; straggler: {traced['straggler']['verdict']}", flush=True)
in_sync = hpctrain.ranks_in_sync(model)
if ctx.rank == 0:
    print(json.dumps({"step": step, "in_sync": in_sync, "param_sha256": hpctrain.param_hash(model),
                      "stopped": stopped, "asked_by": ck.asked_by}))
raise SystemExit(3 if stopped else 0)
