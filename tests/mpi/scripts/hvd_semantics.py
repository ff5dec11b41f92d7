"""What Horovod's users rely on from hpctrain.horovod, beyond Horovod's own suite (run on 2 ranks):
matching by name in different orders, errors on every rank that name the tensor and the ranks, join, async
handles, and DistributedOptimizer giving the same model as averaging by hand. Prints SEMANTICS OK per rank."""

import sys
import time

import torch

import hpctrain.horovod as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert size == 2, size

# 1. ranks submit in different orders: matched by name, not by call order
names = ["a", "b", "c"]
tensors = {n: torch.full((5,), float(i + 1)) * (rank + 1) for i, n in enumerate(names)}
order = names if rank == 0 else names[::-1]
handles = {}
if rank == 0:  # rank 1 submits after the barrier: until then rank 0's handles cannot be done
    handles = {n: hvd.allreduce_async(tensors[n], name=n, op=hvd.Sum) for n in order}
    assert not any(hvd.poll(h) for h in handles.values())  # in flight: the thread does the work
hvd.barrier()
if rank == 1:
    handles = {n: hvd.allreduce_async(tensors[n], name=n, op=hvd.Sum) for n in order}
for i, n in enumerate(names):
    assert torch.equal(hvd.synchronize(handles[n]), torch.full((5,), float(i + 1) * 3)), n

# 2. a mismatch fails on every rank, naming the tensor and the ranks
for shape in ([4, 6] if rank == 0 else [6, 4], [3] if rank == 0 else [4]):
    try:
        hvd.allreduce(torch.ones(*shape), name="mismatch")
    except RuntimeError as exc:
        text = str(exc)
        assert "'allreduce.mismatch'" in text and "rank 0" in text and "rank 1" in text and "shape" in text, text
    else:
        sys.exit(f"rank {rank}: no error for a shape mismatch")
try:
    hvd.broadcast(torch.ones(3), root_rank=rank, name="roots")
except RuntimeError as exc:
    assert "root" in str(exc), exc
else:
    sys.exit("no error for different roots")

# 3. join: the joined rank adds zeros, the divisor stays the world size, everyone learns the last to join
if rank == 0:
    last = hvd.join()
else:
    averaged = hvd.allreduce(torch.full((4,), 6.0), name="during_join")
    assert torch.equal(averaged, torch.full((4,), 3.0)), averaged
    last = hvd.join()
assert last == 1, last

# 4. DistributedOptimizer: the same step as averaging the ranks' gradients by hand
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
reference.load_state_dict(model.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
batches = [torch.randn(6, 8, generator=torch.Generator().manual_seed(r)) for r in range(size)]
loss = model(batches[rank]).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
ref_opt.zero_grad()
(sum(reference(b).pow(2).mean() for b in batches) / size).backward()
ref_opt.step()
for p, q in zip(model.parameters(), reference.parameters()):
    assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()

# 5. a name reused while in flight: ValueError at once, on the rank that did it. Each rank's name is its own
# until the barrier, so nothing can complete it before the second submission (no race under load).
pending = hvd.allreduce_async(torch.ones(2), name=f"twice{rank}")
try:
    hvd.allreduce_async(torch.ones(2), name=f"twice{rank}")
except ValueError as exc:
    assert f"twice{rank}" in str(exc)
else:
    sys.exit("no ValueError for a duplicate name in flight")
hvd.barrier()
other = hvd.allreduce_async(torch.ones(2), name=f"twice{1 - rank}")
hvd.synchronize(pending)
hvd.synchronize(other)
hvd.barrier()

# 6. the same when the first has completed before the second submission: as under load, when the other rank was
# quick. Still a ValueError, for the first is not synchronized yet (accepted, the second waited forever for a
# partner, and Horovod's own duplicate-name tests hung so). A synchronize frees the name.
if rank == 0:
    first = hvd.broadcast_async(torch.ones(3), root_rank=0, name="again")
hvd.barrier()
if rank == 1:
    first = hvd.broadcast_async(torch.ones(3), root_rank=0, name="again")
    while not hvd.poll(first):
        time.sleep(0.001)
    try:
        hvd.broadcast_async(torch.ones(3), root_rank=0, name="again")
    except ValueError as exc:
        assert "again" in str(exc) and "not synchronized" in str(exc), exc
    else:
        sys.exit("a name submitted again after its operation completed, before it was synchronized, was accepted")
hvd.synchronize(first)
hvd.synchronize(hvd.broadcast_async(torch.ones(3), root_rank=0, name="again"))
# a handle given up on (never synchronized) holds its name only until the rank's next synchronize
left = hvd.allreduce_async(torch.ones(2), name="left")
while not hvd.poll(left):
    time.sleep(0.001)
hvd.barrier()
hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="left"))
hvd.barrier()
print(f"SEMANTICS OK {rank}", flush=True)
