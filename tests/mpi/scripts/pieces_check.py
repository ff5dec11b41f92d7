"""Under mpirun -n N on one node: the engine's allreduce of a host bucket larger than its piece size, in pieces,
gives every rank the same sum as one whole MPI Allreduce: exact sums (small integers) in fp32 and on 16-bit
wires, random floats identical on every rank (and bit for bit the whole Allreduce's on 2 ranks), pieces that do
not divide the bucket, and a bucket no larger than a piece summed whole. A world on one node cuts pieces by
default; one the launcher spread over nodes does not."""

import torch

from hpctrain.base.rankenv import RankEnv
from hpctrain.comm import world
from hpctrain.comm.collectives import PIECE_BYTES, Collectives, one_node
from hpctrain.comm.wire import buffer_spec, scaled_sum
from hpctrain.comm.world import load_mpi

comm = world()
MPI = load_mpi()
size, rank = comm.size, comm.rank
colls = Collectives(comm)
assert colls.piece_bytes == (PIECE_BYTES if size > 1 else 0), colls.piece_bytes
assert not one_node(RankEnv(world_size=4, local_size=2)) and one_node(RankEnv(world_size=4, local_size=4))
assert not one_node(RankEnv(world_size=None, local_size=1))

pieces: list[int] = []
whole_allreduce = comm.mpi.Allreduce


class Counting:
    """comm.mpi with its Allreduce calls counted (the number of pieces)."""

    def __getattr__(self, name):
        return getattr(comm.mpi, name)

    def Allreduce(self, *args, **kwargs):
        pieces.append(1)
        return whole_allreduce(*args, **kwargs)


colls.comm = type(comm)(comm.mpi)
colls.comm.mpi = Counting()
colls.piece_bytes = 64  # 16 float32: many pieces, the last one short
for n in (16 * 5 + 7, 16, 3):
    for kind in ("none", "fp16", "bf16"):
        # small integers: every fp32 sum exact in any order, so the pieces must give the exact sum; a 16-bit
        # wire divides by the world size first (not exact on 3 ranks): the pieces must give the whole's bits
        expected = sum(torch.arange(n, dtype=torch.float32) % 13 + r for r in range(size))
        buf = torch.arange(n, dtype=torch.float32) % 13 + rank
        whole = buf.clone()
        pieces.clear()
        scaled_sum(buf, buf, kind, 1.0, 1.0, size, colls.allreduce, MPI)
        if size > 1:
            wire_bytes = n * (4 if kind == "none" else 2)
            assert len(pieces) == max(1, -(-wire_bytes // 64)), (n, kind, len(pieces))
        colls.piece_bytes = 0
        scaled_sum(whole, whole, kind, 1.0, 1.0, size, colls.allreduce, MPI)
        colls.piece_bytes = 64
        assert torch.equal(buf, whole), (n, kind, buf, whole)
        if kind == "none" or size <= 2:
            assert torch.equal(buf, expected), (n, kind, buf, expected)
    rng = torch.Generator().manual_seed(rank)
    buf = torch.randn(n, generator=rng) * 1e3
    whole = buf.clone()
    colls.allreduce(buf, buf, MPI.SUM)
    comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(whole, MPI), op=MPI.SUM)
    first = buf.clone()
    comm.mpi.Bcast(buffer_spec(first, MPI), root=0)
    assert torch.equal(buf, first), "the ranks' sums differ"
    if size <= 2:
        assert torch.equal(buf, whole), (n, buf - whole)
    else:
        assert torch.allclose(buf, whole, rtol=1e-5, atol=1e-3), (n, buf - whole)
if rank == 0:
    print("PIECES OK", size)
