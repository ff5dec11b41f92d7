"""The collectives of the gradient engine (`gradsync.GradSync`) on one communicator: every MPI call a step's
gradients and parameters make is here.

- `allreduce`: the in-place sum of a bucket over all ranks: flat (in 1 MiB pieces on one node), hierarchical
  (node, then node leaders, then node) or in a fixed rank order (`--deterministic`);
- `reduce_scatter`: the sum of a bucket into this rank's slice, by MPI Reduce_scatter_block (slices of equal
  size), Reduce_scatter, an Allreduce of which each rank keeps its slice, a ring of Sendrecv exchanges summed
  by torch, or in rank order;
- `allgather`: every rank's slice of a bucket into the whole bucket on every rank (ZeRO's parameters);
- `fastest_reducer`: times the four reducers in turns on the largest bucket and keeps the fastest.

MPI libraries differ on the reducers: on one node Open MPI 4.1's Allreduce sums a large bucket several times
faster than its Reduce_scatter(_block), while on a network a reduce-scatter sends half the bytes of an
allreduce; so `--zero-reduce auto` measures. Every tensor goes to MPI through
`wire.buffer_spec`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..base.config import ZERO_REDUCERS as REDUCERS
from ..base.rankenv import RankEnv, read_env
from .wire import buffer_spec
from .world import Comm, load_mpi

PROBE_ROUNDS = 5  # `fastest_reducer`'s timed rounds of every reducer, after one warm-up round
PIECE_BYTES = 1 << 20  # the allreduce of a larger host bucket on one node goes in pieces of this size
RING_TAG = 0x5253  # the ring reducer's messages (it runs alone on its communicator, in every rank's same order)


def one_node(env: RankEnv) -> bool:
    """Whether the launcher put every rank of the job on this node (as far as its variables say: unknown is
    no), so that every communicator of the job moves its messages through shared memory."""
    return env.world_size is not None and env.world_size > 1 and env.local_size >= env.world_size


def node_groups(comm: Comm, node_key: int | None) -> tuple[Comm, Comm | None]:
    """The communicators of a hierarchical sum: this node's ranks, and the node leaders (None off them)."""
    MPI = load_mpi()
    # node_key lets tests emulate several nodes on one host; by default: who shares memory
    local = (comm.mpi.Split(node_key, comm.rank) if node_key is not None
             else comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank))
    local_comm = Comm(local)
    leaders = comm.mpi.Split(0 if local_comm.rank == 0 else MPI.UNDEFINED, comm.rank)  # collective
    return local_comm, (Comm(leaders) if leaders != MPI.COMM_NULL else None)


def vspec(tensor: Any, counts: list[int], MPI: Any, *, resizable: bool = False) -> list[Any]:
    """An mpi4py buffer spec with per-rank counts and displacements (the v-collectives)."""
    displs, at = [], 0
    for c in counts:
        displs.append(at)
        at += c
    spec = buffer_spec(tensor, MPI, resizable=resizable)
    if isinstance(spec, list):  # 16-bit: [raw memory, the 2-byte datatype]
        return [spec[0], (counts, displs), spec[1]]
    return [spec, (counts, displs)]


class Collectives:
    """The gradient engine's collectives over `comm`. `reducer` is how `reduce_scatter` sums (one of
    `ZERO_REDUCERS` but auto); `deterministic` sums in rank order in float32 whatever MPI's algorithm."""

    def __init__(self, comm: Comm, *, deterministic: bool = False, hierarchical: bool = False,
                 node_key: int | None = None):
        self.comm = comm
        self.deterministic = deterministic and comm.size > 1
        self.reducer = "reduce-scatter"
        # the allreduce of a host bucket larger than this goes in pieces of it (0: whole), see `_sum_in_pieces`
        self.piece_bytes = PIECE_BYTES if comm.size > 1 and one_node(read_env()) else 0
        self.local: Comm | None = None
        self.leaders: Comm | None = None
        if hierarchical and comm.size > 1:
            self.local, self.leaders = node_groups(comm, node_key)

    # -- sums ------------------------------------------------------------------------------------------
    def allreduce(self, buf: Any, out: Any, op: Any) -> None:
        """In-place sum of `buf` over all ranks (`out` is `buf`: the signature `wire.scaled_sum` calls)."""
        MPI = load_mpi()
        if self.deterministic:
            self._ordered_sum(buf)
        elif self.local is not None:
            # node-local reduce to the node leader, leaders allreduce, node-local broadcast
            spec = buffer_spec(buf, MPI)
            if self.local.size > 1:
                self.local.mpi.Reduce(MPI.IN_PLACE if self.local.rank == 0 else spec, spec, op=op, root=0)
            if self.leaders is not None and self.leaders.size > 1:
                self.leaders.mpi.Allreduce(MPI.IN_PLACE, spec, op=op)
            if self.local.size > 1:
                self.local.mpi.Bcast(spec, root=0)
        elif (self.piece_bytes and not buf.is_cuda and buf.is_contiguous()
              and buf.numel() * buf.element_size() > self.piece_bytes):
            self._sum_in_pieces(buf, op)
        else:
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(buf, MPI), op=op)

    def _sum_in_pieces(self, buf: Any, op: Any) -> None:
        """In-place sum of a host `buf` over the ranks of one node, an Allreduce per `piece_bytes` of it. Open MPI
        sums a large message through buffers as large as it is, so a 16 MB gradient is read back from the
        last-level cache or memory; a piece and MPI's buffers for it stay in the core's own cache, which makes
        the step a little faster where the cores' caches are small (docs/performance.md). Only where every rank shares one node: over a network MPI pipelines a large message itself, and each
        piece would pay the network's latency. Every rank cuts the same pieces, so the collectives match, and
        every rank gets the same sum, MPI's (on 2 ranks bit for bit the whole Allreduce's: a + b either way).
        """
        MPI = load_mpi()
        flat = buf.view(-1)
        step = max(1, self.piece_bytes // flat.element_size())
        for at in range(0, flat.numel(), step):
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(flat[at:at + step], MPI), op=op)

    def reduce_scatter(self, send: Any, out: Any, counts: list[int], op: Any, how: str | None = None) -> None:
        """This rank's slice of the sum of `send` over the ranks, into `out`, by `how` (default: `reducer`).
        With the allreduce, `send` ends up holding the whole sum."""
        MPI = load_mpi()
        how = how or self.reducer
        if self.deterministic:
            self._ordered_scatter_sum(send, out, counts)
        elif how == "allreduce":
            self.comm.mpi.Allreduce(MPI.IN_PLACE, buffer_spec(send, MPI), op=op)
            lo = sum(counts[:self.comm.rank])
            out.copy_(send[lo:lo + counts[self.comm.rank]])
        elif how == "ring":
            self._ring_reduce_scatter(send, out, counts)
        elif how == "reduce-scatter-block" and len(set(counts)) == 1:  # `out` resizable: ZeRO 3 frees it between steps
            self.comm.mpi.Reduce_scatter_block(buffer_spec(send, MPI), buffer_spec(out, MPI, resizable=True), op=op)
        else:
            self.comm.mpi.Reduce_scatter(buffer_spec(send, MPI), buffer_spec(out, MPI, resizable=True),
                                         recvcounts=counts, op=op)

    def _ring_reduce_scatter(self, send: Any, out: Any, counts: list[int]) -> None:
        """The sum of `send` over the ranks, this rank's slice of it into `out`, around the ring of ranks: W - 1
        exchanges (MPI_Sendrecv) of one slice each, every received slice added by torch into `send`, which this
        overwrites. Each slice is received into `out` (the last, then this rank's own slice added to it), so no
        buffer of its own is held, unless a slice is larger than `out` or of another dtype. Sums only (what
        ZeRO reduces; a 16-bit wire adds in its own dtype as its MPI op does). On one node this can beat Open
        MPI 4.1's Reduce_scatter(_block) and Allreduce, which is why `fastest_reducer` times it."""
        import torch

        MPI = load_mpi()
        size, rank = self.comm.size, self.comm.rank
        starts = [sum(counts[:i]) for i in range(size + 1)]
        flat, into = send.view(-1), out.view(-1)
        if size == 1:
            into.copy_(flat[:counts[0]])
            return
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            give, take = (rank - 1 - step) % size, (rank - 2 - step) % size  # take == rank at the last step
            n = counts[take]
            got = into[:n] if n <= into.numel() and into.dtype == flat.dtype else torch.empty(
                n, dtype=flat.dtype, device=flat.device)
            self.comm.mpi.Sendrecv(buffer_spec(flat[starts[give]:starts[give + 1]], MPI), dest=right,
                                   sendtag=RING_TAG, recvbuf=buffer_spec(got, MPI, resizable=True), source=left,
                                   recvtag=RING_TAG)
            mine = flat[starts[take]:starts[take + 1]]
            if step < size - 2:
                mine.add_(got)
            elif got is into:
                into.add_(mine)
            else:
                torch.add(mine, got, out=into)

    def allgather(self, full: Any, counts: list[int], shard: Any = None) -> None:
        """Every rank's slice into `full` on every rank: in place (this rank's slice already sits at its place
        in `full`) when `shard` is None, else from `shard`."""
        MPI = load_mpi()
        if len(set(counts)) == 1:
            self.comm.mpi.Allgather(MPI.IN_PLACE if shard is None else buffer_spec(shard, MPI),
                                    buffer_spec(full, MPI, resizable=True))
        else:
            self.comm.mpi.Allgatherv(MPI.IN_PLACE if shard is None else buffer_spec(shard, MPI),
                                     vspec(full, counts, MPI, resizable=True))

    # -- the choice of reducer -------------------------------------------------------------------------
    def fastest_reducer(self, send: Any, out: Any, counts: list[int], packed: bool = False) -> tuple[str, str]:
        """Time each reducer on `send` and return the fastest and the times in words: the reducers in turns, a
        warm-up round and then `PROBE_ROUNDS` rounds of every one (the order reversed every other round, the same
        on every rank), each one's median, the slowest rank's. The times are the same on every rank, and so is the
        choice. In turns, a slow spell of the machine (a busy neighbour, a preempted rank) falls on every reducer
        alike, where timing one reducer after another let one spell pick a reducer twice as slow as the
        best. `packed`: the reduce-scatters of this bucket first pack it (a copy of its bytes)
        and the allreduce does not (it sums its large gradients in their own memory): their times include such
        a copy (one half of `send` into the other and back, no second buffer)."""
        import torch

        MPI = load_mpi()
        order = list(REDUCERS[1:])
        runs: dict[str, list[float]] = {how: [] for how in order}
        for r in range(PROBE_ROUNDS + 1):  # round 0 warms every reducer up (its buffers, the ring's first messages)
            for how in (order if r % 2 == 0 else order[::-1]):
                if send.is_cuda:
                    torch.cuda.synchronize(send.device)
                start = time.perf_counter()
                if packed and how != "allreduce":
                    half = send.numel() // 2
                    send[:half].copy_(send[half:2 * half])
                    send[half:2 * half].copy_(send[:half])
                self.reduce_scatter(send, out, counts, MPI.SUM, how)
                if r:
                    runs[how].append(time.perf_counter() - start)
        times = [statistics.median(runs[how]) for how in order]
        slowest = self.comm.allreduce_array(times, op="max")
        probe = ", ".join(f"{how} {t * 1e3:.2f} ms" for how, t in zip(REDUCERS[1:], slowest))
        return REDUCERS[1 + int(slowest.argmin())], probe

    # -- in rank order ---------------------------------------------------------------------------------
    def _ordered_sum(self, buf: Any, chunk: int = 1 << 22) -> None:
        """Sum in rank order (((g0 + g1) + g2) + ...), accumulating in float32, whatever MPI's algorithm:
        the same bits in every run and on every rank. Costs an allgather (W x the traffic), in chunks."""
        import torch

        MPI = load_mpi()
        flat = buf.view(-1)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            gathered = torch.empty((self.comm.size, part.numel()), dtype=part.dtype, device=part.device)
            self.comm.mpi.Allgather(buffer_spec(part.contiguous(), MPI), buffer_spec(gathered, MPI))
            total = gathered[0].float()
            for r in range(1, self.comm.size):
                total += gathered[r].float()
            part.copy_(total)

    def _ordered_scatter_sum(self, send: Any, out: Any, counts: list[int]) -> None:
        """Each rank receives every rank's copy of its slice (Alltoallv) and sums them in rank order,
        accumulating in float32: the same bits in every run, whatever MPI's algorithm."""
        import torch

        MPI = load_mpi()
        mine = counts[self.comm.rank]
        received = torch.empty(self.comm.size * mine, dtype=send.dtype, device=send.device)
        self.comm.mpi.Alltoallv(vspec(send, counts, MPI), vspec(received, [mine] * self.comm.size, MPI))
        total = received[:mine].float()
        for r in range(1, self.comm.size):
            total += received[r * mine:(r + 1) * mine].float()
        out.copy_(total)
