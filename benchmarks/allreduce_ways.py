#!/usr/bin/env python3
"""Ways to sum the reference MLP's gradients over the ranks of one node, against the engine's (issue 25).

Run under mpirun, one torch thread a rank. Every way sums the same 23.3 MB of float32 in place, each time
into a fresh copy of the gradient after 70 MB of other memory was written (as a step's backward and fused
SGD stream memory before the next sum), after a barrier; every way is timed in every round, the order
reversed every other round, and each way's figure is the median over the rounds of its rounds' medians (the
slowest rank's):
- `mpi pieces`: the engine's own sum (`Collectives.allreduce`), an in-place MPI Allreduce per 1 MiB piece on
  one node, the reference the others are divided by;
- `mpi whole`: the engine's sum with pieces off, one Allreduce of the whole buffer (its way before 75464c4,
  and over a network);
- `ring whole`, `ring pieces`: a reduce-scatter then an allgather around the ring of ranks, each an
  MPI_Sendrecv of one slice per exchange (a single copy from the peer's memory in Open MPI's vader BTL),
  the received slice added by torch; whole or in 1 MiB pieces. The fewest bytes moved on 2 ranks: each rank
  copies half the buffer in, adds it, and copies the other half's sum in;
- `window`: the buffer's parts copied into an MPI shared-memory window (`Win.Allocate_shared`), each rank
  adding the others' copies of its own part there, then copying every part's sum back out: no MPI message
  at all, plain loads and stores between the two barriers of each phase.
Every way is checked first: on 2 ranks each must equal the whole Allreduce bit for bit (a + b is b + a);
on more, every rank must hold the same bits, within float rounding of the whole Allreduce.

MPI's own algorithms for the pieces are chosen from outside, by Open MPI's variables:
`mpirun -n 2 -x OMPI_MCA_coll_tuned_use_dynamic_rules=1 -x OMPI_MCA_coll_tuned_allreduce_algorithm=N`
(1 basic linear, 2 nonoverlapping, 3 recursive doubling, 4 ring, 5 segmented ring, 6 Rabenseifner).

Measured on the 2-core CI machine (2026-12-06, 2 ranks; docs/performance.md). At 10:30, with the engine's
piece loop copied into this script: `mpi pieces` 4.34 and 4.40 ms with `train`'s memory settings, 5.41 with
`--plain-memory` (glibc's and torch's defaults, as a script without hpctrain has them); against it `mpi whole`
1.07-1.12x, the ring 1.13-1.21x, the window 1.45-1.92x; Open MPI's own algorithms for the pieces 7.3-8.7 ms
for 1-3, 3.95-4.2 for 4-6, its default choice 4.06-4.13. At noon, calling the engine as now, three launches:
`mpi pieces` 5.8-6.8 ms, `mpi whole` 0.88-1.03x of it, the ring whole 0.90-1.04x, in pieces 1.02-1.25x, the
window 1.16-1.38x (the copied loop in the same minutes: whole 0.93-0.96x of pieces). So no way is reliably
faster than the engine's; whether pieces beat one whole Allreduce of the raw sum moves with the machine's hour
(in `train`'s step, `benchmarks/allreduce_pieces.py`: 0.970-1.000 in four launches that morning, 1.006 at
noon). A torch copy or add of half the buffer takes 1.1-1.2 ms here: the sum is bound by memory.

    mpirun -n 2 python benchmarks/allreduce_ways.py [--rounds 4] [--iters 15] [--plain-memory] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

if "--plain-memory" not in sys.argv:  # before torch allocates: it reads its huge-page setting once
    from hpctrain.base.hostmem import prefer_huge_pages, reuse_freed_memory

    prefer_huge_pages()
    reuse_freed_memory()

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.comm import Comm  # noqa: E402
from hpctrain.comm.collectives import PIECE_BYTES, Collectives  # noqa: E402

NUMEL = 23_298_088 // 4  # the reference MLP's (784-2048-2048-10) gradient, float32
PIECE = PIECE_BYTES // 4  # the engine's piece, in float32


class Ways:
    """The sums, each in place on a flat float32 tensor of `NUMEL` over `comm`."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.pieces, self.whole = Collectives(Comm(comm)), Collectives(Comm(comm))
        self.pieces.piece_bytes, self.whole.piece_bytes = PIECE_BYTES, 0  # as on one node, and as without pieces
        self.tmp = torch.empty(NUMEL)
        self.win = MPI.Win.Allocate_shared(NUMEL * 4, 4, comm=comm)
        self.segs = [torch.frombuffer(self.win.Shared_query(q)[0], dtype=torch.float32, count=NUMEL)
                     for q in range(self.size)]
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def close(self) -> None:
        self.win.Unlock_all()
        self.win.Free()

    def mpi_whole(self, t: torch.Tensor) -> None:
        self.whole.allreduce(t, t, MPI.SUM)

    def mpi_pieces(self, t: torch.Tensor) -> None:
        self.pieces.allreduce(t, t, MPI.SUM)

    def ring_whole(self, t: torch.Tensor) -> None:
        self._ring(t)

    def ring_pieces(self, t: torch.Tensor) -> None:
        for at in range(0, t.numel(), PIECE):
            self._ring(t[at:at + PIECE])

    def _ring(self, flat: torch.Tensor) -> None:
        size, rank = self.size, self.rank
        b = [flat.numel() * i // size for i in range(size + 1)]
        right, left = (rank + 1) % size, (rank - 1) % size
        for s in range(size - 1):  # reduce-scatter: afterwards slice (rank + 1) % size holds the sum
            give, take = (rank - s) % size, (rank - s - 1) % size
            got = self.tmp[:b[take + 1] - b[take]]
            self.comm.Sendrecv([flat[b[give]:b[give + 1]].numpy(), MPI.FLOAT], dest=right,
                               recvbuf=[got.numpy(), MPI.FLOAT], source=left)
            flat[b[take]:b[take + 1]].add_(got)
        for s in range(size - 1):  # allgather of the summed slices
            give, take = (rank + 1 - s) % size, (rank - s) % size
            self.comm.Sendrecv([flat[b[give]:b[give + 1]].numpy(), MPI.FLOAT], dest=right,
                               recvbuf=[flat[b[take]:b[take + 1]].numpy(), MPI.FLOAT], source=left)

    def _sync(self) -> None:
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def window(self, t: torch.Tensor) -> None:
        size, rank, segs = self.size, self.rank, self.segs
        b = [t.numel() * i // size for i in range(size + 1)]
        for q in range(size):  # publish the parts the others sum
            if q != rank:
                segs[rank][b[q]:b[q + 1]].copy_(t[b[q]:b[q + 1]])
        self._sync()
        mine = t[b[rank]:b[rank + 1]]
        for q in range(size):  # rank order: the same bits whoever sums
            if q != rank:
                mine.add_(segs[q][b[rank]:b[rank + 1]])
        segs[rank][b[rank]:b[rank + 1]].copy_(mine)
        self._sync()
        for q in range(size):
            if q != rank:
                t[b[q]:b[q + 1]].copy_(segs[q][b[q]:b[q + 1]])
        self._sync()  # nobody overwrites its segment before every rank has read it


NAMES = ("mpi_pieces", "mpi_whole", "ring_whole", "ring_pieces", "window")


def _check(ways: Ways, grad: torch.Tensor) -> None:
    comm = ways.comm
    ref = grad.clone()
    comm.Allreduce(MPI.IN_PLACE, [ref.numpy(), MPI.FLOAT])
    for name in NAMES:
        t = grad.clone()
        getattr(ways, name)(t)
        same = torch.equal(t, ref) if comm.size == 2 else torch.allclose(t, ref, rtol=1e-5, atol=1e-6)
        digest = comm.allgather(hashlib.sha256(t.numpy().tobytes()).hexdigest())
        if not same or len(set(digest)) != 1:
            raise SystemExit(f"{name}: rank {comm.rank} holds another sum (equal to MPI's: {same}; "
                             f"the same bits on every rank: {len(set(digest)) == 1})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=15, help="timed sums of each way a round")
    ap.add_argument("--plain-memory", action="store_true", help="glibc's and torch's memory defaults")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(comm.rank)
    grad, scratch = torch.randn(NUMEL), torch.randn(3 * NUMEL)
    ways = Ways(comm)
    try:
        _check(ways, grad)
        rows: dict[str, list[float]] = {name: [] for name in NAMES}
        for r in range(args.rounds):
            for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
                fn, times = getattr(ways, name), []
                for _ in range(args.iters):
                    t = grad.clone()
                    scratch.mul_(1.0001)  # the memory traffic of a step before its sum
                    comm.Barrier()
                    t0 = time.perf_counter()
                    fn(t)
                    times.append(time.perf_counter() - t0)
                rows[name].append(comm.allreduce(statistics.median(times), op=MPI.MAX) * 1e3)
    finally:
        ways.close()
    if comm.rank != 0:
        return
    ms = {name: statistics.median(v) for name, v in rows.items()}
    result = {"ranks": comm.size, "rounds": args.rounds, "ms": ms, "per_round_ms": rows,
              "over_mpi_pieces": {name: ms[name] / ms["mpi_pieces"] for name in NAMES}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"sum of {NUMEL * 4 / 1e6:.1f} MB over {comm.size} ranks, {args.rounds} rounds "
          f"(median of the rounds' medians, the slowest rank):")
    for name in NAMES:
        v = rows[name]
        print(f"  {name:<12} {ms[name]:6.2f} ms  ({min(v):.2f}-{max(v):.2f})  "
              f"{result['over_mpi_pieces'][name]:.2f}x the engine's")


if __name__ == "__main__":
    main()
