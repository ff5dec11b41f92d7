"""Under mpirun -n 2: gradient sync faults that used to hang or corrupt silently.

mode `error`: rank 0's reduction of the first bucket fails after its collective; the other buckets must
still be reduced on rank 0 (rank 1 enters their collectives), and rank 0's wait() raises CommError.
mode `double-backward`: a second backward without no_sync() while buckets are on the wire must raise.
mode `broadcast`: bfloat16, bool, float16 and non-contiguous tensors broadcast from rank 0.
"""

import sys

import torch

import hpctrain
from hpctrain.comm import GradSync
from hpctrain.base.errors import CommError

ctx = hpctrain.init()
mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
hpctrain.broadcast_parameters(model)
x = torch.randn(8, 64, generator=torch.Generator().manual_seed(ctx.rank))

if mode == "error":
    sync = GradSync(model.parameters(), ctx.comm, bucket_mb=0.02, overlap=True)
    assert len(sync.buckets) >= 4, len(sync.buckets)
    original = sync.strategy._sum  # the sum of one bucket's gradients over the ranks (whole-gradient strategy)
    failed = []

    def flaky(flat, bucket):
        original(flat, bucket)
        if ctx.rank == 0 and not failed:
            failed.append(bucket.index)
            raise RuntimeError("injected failure after the collective")

    sync.strategy._sum = flaky
    sync.zero()
    model(x).sum().backward()
    try:
        sync.wait()
        outcome = "no error"
    except CommError as exc:
        outcome = f"CommError: {exc}"
    # every rank must be able to run one more collective now: the buckets were all entered on both ranks
    total = ctx.comm.allreduce_array([1.0])[0]
    sync.close()
    print(f"rank {ctx.rank} {outcome if ctx.rank == 0 else 'done'} {total:g}", flush=True)
elif mode == "double-backward":
    sync = GradSync(model.parameters(), ctx.comm, bucket_mb=0.02, overlap=True)
    sync.zero()
    model(x).sum().backward()
    try:
        model(x).sum().backward()  # accumulates into buckets that may be on the wire
        outcome = "no error"
    except (RuntimeError, CommError) as exc:
        outcome = "raised no_sync" if "no_sync" in str(exc) else f"raised other {exc}"
    sync.wait()
    sync.close()
    print(f"rank {ctx.rank} {outcome}", flush=True)
elif mode == "broadcast":
    tensors = [torch.full((3,), float(ctx.rank + 1), dtype=torch.bfloat16),
               torch.tensor([ctx.rank == 0, ctx.rank == 1]),
               torch.full((2, 2), float(ctx.rank + 1), dtype=torch.float16),
               torch.arange(12.0).reshape(3, 4).mul(ctx.rank + 1).t()]  # not contiguous
    ctx.comm.broadcast_tensors(tensors)
    want = [torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False]), torch.ones(2, 2, dtype=torch.float16),
            torch.arange(12.0).reshape(3, 4).t()]
    assert all(torch.equal(t, w) for t, w in zip(tensors, want)), tensors
    print(f"rank {ctx.rank} broadcast ok", flush=True)
