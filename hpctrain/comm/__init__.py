"""The comm layer: the only code that touches mpi4py (broadcast, gradient allreduce, 16-bit wire formats).

Its public names, imported from here (`from ..comm import Comm, world`):
`world` (MPI start-up, lazily), `Comm`, `self_comm`, `mpi_info`/`MpiInfo`, `cuda_aware` (world.py) and
`GradSync` (gradsync.py), `ZeroSync` (zero.py: ZeRO stages 1 and 2) and `ShardedOptimizer` with its checkpoint
state (zerooptim.py). wire.py holds the 16-bit wire formats and MPI ops that GradSync uses.
"""

from .gradsync import GradSync
from .world import Comm, MpiInfo, cuda_aware, mpi_info, self_comm, world
from .zero import ZeroSync
from .zerooptim import ShardedOptimizer, checkpoint_entries, full_state, load_entries

__all__ = ["Comm", "GradSync", "MpiInfo", "ShardedOptimizer", "ZeroSync", "checkpoint_entries", "cuda_aware",
           "full_state", "load_entries", "mpi_info", "self_comm", "world"]
