"""Process state of `hpctrain.horovod`: init and shutdown, ranks and sizes, build probes, process sets.

The answers come from MPI (hpctrain's comm layer): `local_rank` and `local_size` from the ranks sharing this
node's memory, `cross_rank` and `cross_size` over the nodes. The build probes answer for this library, not
for a Horovod build: MPI is built and enabled; Gloo, NCCL, DDL, oneCCL and ROCm are not; CUDA tensors are
accepted (staged through host memory) whenever torch has CUDA.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Iterable

from ..base.hostmem import tune_unless_decided
from ..comm.procsets import ProcessGroup, Topology, registry, topology

_LOCK = threading.RLock()


class _State:
    topology: Topology | None = None
    registry: Any = None
    sets: dict[int, "ProcessSet"] = {}


STATE = _State()


class ProcessSet:
    """A subset of the ranks that run collectives together (Horovod's `hvd.ProcessSet`): pass it as
    `process_set=` to any collective. Build one with `hvd.add_process_set(ranks)` (collective: every rank
    calls it) or pass it to `hvd.init(process_sets=[...])`."""

    def __init__(self, ranks: Iterable[int] | None = None):
        self.ranks: list[int] | None = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = None
        self.group: ProcessGroup | None = None
        self.barriers = 0  # barriers run on this set so far (names them alike on every member)

    def _bind(self, process_set_id: int, group: ProcessGroup) -> None:
        self.process_set_id, self.group, self.ranks = process_set_id, group, group.ranks

    def size(self) -> int | None:
        return len(self.ranks) if self.ranks is not None else None

    def rank(self) -> int | None:
        """This process's rank within the set (None when it is not a member)."""
        return self.group.rank if self.group is not None else None

    def included(self) -> bool:
        return self.group is not None and self.group.included

    def require(self) -> ProcessGroup:
        if self.group is None:
            raise ValueError("this process set is not registered: call hvd.init() or hvd.add_process_set(ranks) "
                             "on every rank first")
        return self.group

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


def init(comm: Any = None, process_sets: Iterable[ProcessSet] | None = None) -> None:
    """Start MPI and the global process set; safe to call again. `comm` (an mpi4py communicator or a list of
    ranks) is not supported: hpctrain.horovod always runs over COMM_WORLD. Tunes host memory first
    (`hpctrain.tune_host_memory`; rank 0 warns when torch allocated first and so missed its huge pages)."""
    with _LOCK:
        if STATE.topology is not None:
            return
        if comm is not None:
            raise ValueError("hvd.init(comm=...) is not supported by hpctrain.horovod: it runs over COMM_WORLD; "
                             "use process sets (hvd.add_process_set) for subsets of ranks")
        tune_unless_decided()
        STATE.topology = topology()
        _size_threads()
        STATE.registry = registry()
        global_process_set._bind(0, ProcessGroup.create(STATE.registry, list(range(STATE.topology.size))))
        STATE.sets = {0: global_process_set}
        atexit.register(shutdown, 2.0)
    for process_set in process_sets or ():
        add_process_set(process_set)


def _size_threads() -> None:
    """Give torch the CPUs this rank owns, as `hpctrain train` does (unless the user chose: OMP_NUM_THREADS or
    torch.set_num_threads)."""
    import torch

    from ..base.rankenv import read_env

    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == os.cpu_count():
        torch.set_num_threads(read_env().torch_threads())


def shutdown(timeout: float = 10.0) -> None:
    """Stop every negotiation thread (each joined within `timeout` seconds); `init()` starts afresh."""
    with _LOCK:
        for process_set in list(STATE.sets.values()):
            if process_set.group is not None:
                process_set.group.close(timeout)
            if process_set is not global_process_set:
                process_set.group = None
        global_process_set.group = None
        STATE.sets = {}
        if STATE.registry is not None:
            STATE.registry.Free()
        STATE.registry = None
        STATE.topology = None


def is_initialized() -> bool:
    return STATE.topology is not None


def _topology() -> Topology:
    if STATE.topology is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return STATE.topology


def size() -> int:
    return _topology().size


def rank() -> int:
    return _topology().rank


def local_size() -> int:
    return _topology().local_size


def local_rank() -> int:
    return _topology().local_rank


def cross_size() -> int:
    return _topology().cross_size


def cross_rank() -> int:
    return _topology().cross_rank


def is_homogeneous() -> bool:
    return _topology().homogeneous


def mpi_threads_supported() -> bool:
    return _topology().thread_multiple


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("Horovod's timeline is not part of hpctrain.horovod; hpctrain's own cross-rank "
                              "timeline is written by `hpctrain train` (see docs/horovod.md)")


def stop_timeline() -> None:
    raise NotImplementedError("Horovod's timeline is not part of hpctrain.horovod (see docs/horovod.md)")


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks, members or not)."""
    _topology()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise ValueError("a process set needs its ranks: hvd.add_process_set([0, 2])")
    with _LOCK:
        if process_set.process_set_id is not None:
            raise ValueError(f"{process_set} is registered already")
        for other in STATE.sets.values():
            if other.ranks == process_set.ranks:
                raise ValueError(f"a process set with ranks {process_set.ranks} exists already: {other}")
        bad = [r for r in process_set.ranks if not 0 <= r < size()]
        if bad or len(set(process_set.ranks)) != len(process_set.ranks):
            raise ValueError(f"process set ranks {process_set.ranks}: each must be distinct and in 0..{size() - 1}")
        process_set._bind(max(STATE.sets) + 1, ProcessGroup.create(STATE.registry, process_set.ranks))
        STATE.sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective, like add_process_set); the global set cannot be removed."""
    with _LOCK:
        if process_set is global_process_set or process_set.process_set_id not in STATE.sets:
            return False
        del STATE.sets[process_set.process_set_id]
        if process_set.group is not None:
            process_set.group.close()
        process_set.group = None
        process_set.process_set_id = None
        STATE.registry.Barrier()
    return True
