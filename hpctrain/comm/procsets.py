"""Process groups for negotiated collectives: the world, or a subset of its ranks on an MPI sub-communicator.

`Topology` says where this process sits (rank, local rank on its node, the node's index among nodes). A
`ProcessGroup` owns a communicator of its own (no other code issues collectives on it) and, from its first
operation on, the `Negotiator` thread that matches operations by name over it. Creating and removing a group
is collective over the world (every rank calls it, members or not), on a registry communicator that only the
callers' threads use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .negotiate import Entry, Negotiator
from .world import load_mpi


@dataclass(frozen=True, slots=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    thread_multiple: bool


def topology() -> Topology:
    """This process's place in COMM_WORLD, from MPI itself (shared-memory nodes)."""
    MPI = load_mpi()
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, world.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = world.Split(local_rank, world.Get_rank())
    sizes = world.allgather(local_size)
    info = Topology(world.Get_rank(), world.Get_size(), local_rank, local_size, cross.Get_rank(), cross.Get_size(),
                    len(set(sizes)) == 1, MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    local.Free()
    cross.Free()
    return info


def registry() -> Any:
    """A duplicate of COMM_WORLD for creating and removing groups (collective calls of the users' threads)."""
    return load_mpi().COMM_WORLD.Dup()


class ProcessGroup:
    """Ranks (global, sorted) that run negotiated collectives together; `comm` is None on a non-member."""

    def __init__(self, ranks: list[int], comm: Any):
        self.ranks = ranks
        self.comm = comm
        self._negotiator: Negotiator | None = None

    @classmethod
    def create(cls, registry_comm: Any, ranks: list[int]) -> "ProcessGroup":
        """Collective over the registry's ranks: every rank calls it with the same `ranks`."""
        MPI = load_mpi()
        group = registry_comm.Get_group().Incl(ranks)
        comm = registry_comm.Create(group)
        group.Free()
        return cls(ranks, None if comm == MPI.COMM_NULL else comm)

    @property
    def included(self) -> bool:
        return self.comm is not None

    @property
    def rank(self) -> int | None:
        return self.comm.Get_rank() if self.comm is not None else None

    def submit(self, entry: Entry) -> Entry:
        if self.comm is None:
            raise ValueError(f"this rank is not in the process set {self.ranks}: only its members may use it")
        if self._negotiator is None:
            self._negotiator = Negotiator(self.comm, self.ranks, abort=load_mpi().COMM_WORLD.Abort)
        return self._negotiator.submit(entry)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the negotiation thread (once nothing is in flight, or after `timeout`); the communicator is
        freed only when the thread ended (a thread still inside a collective keeps it)."""
        ended = True
        if self._negotiator is not None:
            ended = self._negotiator.close(timeout)
            self._negotiator = None
        if ended and self.comm is not None:
            self.comm.Free()
            self.comm = None
        return ended
