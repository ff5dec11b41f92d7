"""The comm layer: the only code that touches mpi4py (broadcast, gradient allreduce, 16-bit wire formats).

Its public names, imported from here (`from ..comm import Comm, world`):
`world` (MPI start-up, lazily), `Comm`, `self_comm`, `mpi_info`/`MpiInfo`, `cuda_aware` (world.py) and
`GradSync` (gradsync.py: the gradient engine at ZeRO stage 0, 1, 2 or 3, whose strategies are allreduce.py,
zero.py and zero3.py, mapped from the stage's number by `strategy_class` in strategies.py; `ZeroSync` builds it
at stage 1-3) and `ShardedOptimizer` with its checkpoint state
(zerooptim.py). buckets.py owns the buckets, collectives.py the MPI calls of a step, wire.py the 16-bit wire
formats.
"""

from .gradsync import GradSync, ZeroSync
from .strategies import STRATEGIES, strategy_class
from .world import Comm, MpiInfo, cuda_aware, mpi_info, self_comm, world
from .zerooptim import ShardedOptimizer, full_state, sharded_owner

__all__ = ["Comm", "GradSync", "MpiInfo", "STRATEGIES", "ShardedOptimizer", "ZeroSync", "cuda_aware", "full_state",
           "mpi_info", "self_comm", "sharded_owner", "strategy_class", "world"]
