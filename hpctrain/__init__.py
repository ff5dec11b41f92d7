"""hpctrain: data-parallel PyTorch training over MPI on Slurm supercomputers.

Importing this package is cheap and changes nothing process-wide: it neither imports torch, nor initializes
MPI, nor sets an environment variable or an allocator option. The library API (`init`, `broadcast_parameters`,
`broadcast_optimizer_state`, `DistributedOptimizer`, `ShardLoader`, `Checkpointer`, `Timeline`, `ranks_in_sync`)
loads on first use; see `hpctrain.api`. `tune_host_memory` tunes the process's host memory for training
(`base.hostmem`): `init()` calls it, and a script that builds its model before `init()` calls it first.
"""

__version__ = "0.2.0"

_HOSTMEM = ("tune_host_memory",)
_API = ("Context", "init", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
        "ShardLoader", "Checkpointer", "Timeline", "param_hash", "ranks_in_sync")


def __getattr__(name: str):
    if name in _HOSTMEM:
        from .base import hostmem

        return getattr(hostmem, name)
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOSTMEM, *_API])
