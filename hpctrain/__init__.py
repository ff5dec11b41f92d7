"""hpctrain: data-parallel PyTorch training over MPI on Slurm supercomputers.

Importing this package is cheap: it neither imports torch nor initializes MPI. The library API
(`init`, `broadcast_parameters`, `broadcast_optimizer_state`, `DistributedOptimizer`, `ShardLoader`,
`Checkpointer`, `Timeline`, `ranks_in_sync`) loads on first use; see `hpctrain.api`.

The import asks torch for huge pages under large CPU tensors (`base.hostmem.prefer_huge_pages`): torch reads that
setting at its first allocation, so it is set here, before a model exists; MPI then moves gradients between the
ranks of a node at the speed it moves numpy arrays.
"""

from .base.hostmem import prefer_huge_pages

__version__ = "0.1.0"

prefer_huge_pages()

_API = ("Context", "init", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
        "ShardLoader", "Checkpointer", "Timeline", "param_hash", "ranks_in_sync")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
