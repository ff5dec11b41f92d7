"""Under mpirun -n N: a Checkpointer given the LR scheduler resumes the schedule where it stopped: a run stopped
after STOP steps and resumed (fresh model, optimizer and scheduler, as a new job would build them) ends with
the parameters of an uninterrupted run, with a schedule whose LR changes at every step.

argv: RUN_DIR ZERO
"""

import math
import sys
from pathlib import Path

import torch

import hpctrain

ctx = hpctrain.init()
run_dir, zero = Path(sys.argv[1]), int(sys.argv[2])
STEPS, STOP = 10, 4


def build(seed: int) -> tuple[torch.nn.Module, hpctrain.DistributedOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)  # a resumed job's fresh weights differ: the checkpoint must bring them back
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    hpctrain.broadcast_parameters(model)
    base = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    opt = hpctrain.DistributedOptimizer(base, model, zero=zero, bucket_mb=0.0005)
    warmup = 3  # linear warm-up, then a cosine decay: a new LR at every step
    sched = torch.optim.lr_scheduler.LambdaLR(
        base, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup + 1) / STEPS)))
    return model, opt, sched


def train(model, opt, sched, ck, step: int, until: int, lrs: list[float]) -> int:
    while step < until:
        lrs.append(opt.param_groups[0]["lr"])
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)  # the data of a step depends on the step only
        x, y = torch.randn(6, 9, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        step += 1
        if ck is not None:
            ck.step(step, model, opt, scheduler=sched)
    return step


model, opt, sched = build(0)
full_lrs: list[float] = []
train(model, opt, sched, None, 0, STEPS, full_lrs)
assert len(set(full_lrs)) == STEPS, full_lrs  # the LR changes at every step
want = hpctrain.param_hash(model)
opt.close()

model, opt, sched = build(0)
ck = hpctrain.Checkpointer(run_dir, every=0)
assert ck.restore(model, opt, scheduler=sched) == 0
lrs: list[float] = []
step = train(model, opt, sched, ck, 0, STOP, lrs)
ck.close(step, model, opt, scheduler=sched)
opt.close()

model, opt, sched = build(1)
ck = hpctrain.Checkpointer(run_dir, every=0)
step = ck.restore(model, opt, scheduler=sched)
assert step == STOP, step
assert opt.param_groups[0]["lr"] == full_lrs[STOP], (opt.param_groups[0]["lr"], full_lrs[STOP])
step = train(model, opt, sched, ck, step, STEPS, lrs)
assert lrs == full_lrs, (lrs, full_lrs)
ck.close(step, model, opt, scheduler=sched)
got = hpctrain.param_hash(model)
assert got == want, (ctx.rank, zero, got, want)
assert hpctrain.ranks_in_sync(model)
opt.close()
if ctx.rank == 0:
    print("CKPT SCHED OK", ctx.world_size, zero)
