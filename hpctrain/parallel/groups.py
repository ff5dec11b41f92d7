"""The communicators of a hybrid-parallel run, split from the world with MPI_Comm_split.

- `data`: the D ranks at the same (t, p), one per replica: every data-parallel feature (bucketed
  gradient allreduce, overlap, the 16-bit wire, ZeRO 1/2, --deterministic) runs over it unchanged;
- `tensor`: the T ranks of one stage of one replica (neighbours in rank order): the activation sums;
- `pipe`: the P stages of one replica at the same t: point-to-point between neighbour stages;
- `tie` (P > 1): the first and the last stage at the same (d, t), which both hold the tied embedding/head:
  its gradient is summed over them.

Each is named for the flight recorder (its records, and the line-up after a hang, say which group and which
ranks of the run: `Comm.split`); `PIPELINE` is the name the timeline's straggler analysis finds a rank's stage by.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import Comm
from .layout import Layout

DATA, TENSOR, PIPELINE, TIE = "data-parallel group", "tensor-parallel group", "pipeline", "first and last stage"


@dataclass(frozen=True, slots=True)
class Groups:
    world: Comm
    layout: Layout
    d: int
    t: int
    p: int
    data: Comm
    tensor: Comm
    pipe: Comm
    tie: Comm | None

    @property
    def first(self) -> bool:
        return self.p == 0

    @property
    def last(self) -> bool:
        return self.p == self.layout.pipe - 1

    @property
    def reporter(self) -> bool:
        """The rank that reports its replica's loss and samples (the last stage, tensor rank 0): the others'
        counts are 0, so a sum over the world counts each sample once."""
        return self.last and self.t == 0

    def stage_rank(self, p: int) -> int:
        """The world rank of stage `p` of this rank's pipeline (same d and t)."""
        return self.layout.rank(self.d, self.t, p)


def make_groups(world: Comm, layout: Layout) -> Groups:
    """Split `world` (of layout.world ranks) into the groups of `layout` (a collective of every rank)."""
    d, t, p = layout.coords(world.rank)
    data = world.split(layout.rank(0, t, p), d, DATA)
    tensor = world.split(layout.rank(d, 0, p), t, TENSOR)
    pipe = world.split(layout.rank(d, t, 0), p, PIPELINE)
    ends = layout.pipe > 1 and p in (0, layout.pipe - 1)
    tie = world.split(layout.rank(d, t, 0) if ends else None, p, TIE)  # a collective: every rank takes part
    return Groups(world, layout, d, t, p, data, tensor, pipe, tie)
