"""Under mpirun -n N: every ZeRO reducer (hpctrain.base.config.ZERO_REDUCERS but auto) leaves in `out` this rank's
slice of the sum over the ranks, for equal and unequal slices, fp32 and 16-bit, twice in a row (the ring receives
into `out` where a slice fits, else into memory of its own); and the start-up probe times every one of them."""

import torch

from hpctrain.base.config import ZERO_REDUCERS
from hpctrain.comm import world
from hpctrain.comm.collectives import Collectives
from hpctrain.comm.wire import sum_op
from hpctrain.comm.world import load_mpi

comm = world()
colls = Collectives(comm)
MPI = load_mpi()
size, rank = comm.size, comm.rank
for counts in ([7] * size, [5 + 3 * r for r in range(size)]):
    total = sum(counts)
    lo = sum(counts[:rank])
    for dtype, op in ((torch.float32, MPI.SUM), (torch.bfloat16, sum_op("bf16", MPI)), (torch.float16, sum_op("fp16", MPI))):
        # small integers: every sum exact in every dtype and order, so every reducer must give the same bits
        expected = sum(torch.arange(total, dtype=torch.float32) % 13 + r for r in range(size)).to(dtype)
        for how in ZERO_REDUCERS[1:]:
            for _ in range(2):
                send = (torch.arange(total, dtype=torch.float32) % 13 + rank).to(dtype)
                out = torch.full((counts[rank],), -1.0, dtype=dtype)
                colls.reduce_scatter(send, out, counts, op, how)
                assert torch.equal(out, expected[lo:lo + counts[rank]]), (how, dtype, counts, out, expected)
counts = [5 + 3 * r for r in range(size)]
best, probe = colls.fastest_reducer(torch.ones(sum(counts)), torch.empty(counts[rank]), counts)
assert best in ZERO_REDUCERS[1:] and all(f"{how} " in probe for how in ZERO_REDUCERS[1:]), probe
if rank == 0:
    print("REDUCERS OK", size, probe)
