"""Under mpirun -n N: a torch LR scheduler drives a DistributedOptimizer at every ZeRO stage, wherever it is
attached (the user's optimizer before wrapping or after, or the DistributedOptimizer itself): the same
schedule gives the same parameters at zero=0, 1 and 2, and other parameters than no schedule."""

import warnings

import torch

import hpctrain

ctx = hpctrain.init()
STEPS = 6
SCHEDULES = {
    "lambda": (lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
               lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))),
    "step": (lambda p: torch.optim.Adam(p, lr=0.05),
             lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3)),
}


def run(kind: str, zero: int, where: str | None) -> list[torch.Tensor]:
    """Parameters after STEPS steps; `where` the scheduler is attached (None: no scheduler)."""
    make_opt, make_sched = SCHEDULES[kind]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    hpctrain.broadcast_parameters(model)
    base = make_opt(model.parameters())
    sched = make_sched(base) if where == "base-before" else None
    opt = hpctrain.DistributedOptimizer(base, model, zero=zero, bucket_mb=0.0005)
    if where == "base-after":
        sched = make_sched(base)
    elif where == "wrapper":
        sched = make_sched(opt)
    g = torch.Generator().manual_seed(ctx.rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            x, y = torch.randn(6, 9, generator=g), torch.randint(0, 4, (6,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()
                assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0], (kind, zero, where)
    noise = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    assert not noise, (kind, zero, where, noise)
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


failures = []
for kind in SCHEDULES:
    ref = run(kind, 0, "base-before")
    unscheduled = run(kind, 0, None)
    assert max_diff(ref, unscheduled) > 1e-4, (kind, "the schedule changed nothing: a test that cannot fail")
    for zero in (0, 1, 2):
        for where in ("base-before", "base-after", "wrapper"):
            try:
                diff = max_diff(ref, run(kind, zero, where))
            except Exception as exc:  # noqa: BLE001 - reported below, with every other case
                failures.append(f"{kind} zero={zero} {where}: {type(exc).__name__}: {exc}")
                continue
            if diff > 1e-6:
                failures.append(f"{kind} zero={zero} {where}: parameters differ from zero=0 by {diff:.3g}")
for line in failures:
    print(f"rank {ctx.rank} FAIL {line}", flush=True)
if ctx.rank == 0 and not failures:
    print("SCHED OK", ctx.world_size)
