"""Horovod's PyTorch API on hpctrain: `import hpctrain.horovod as hvd` in place of `import horovod.torch as hvd`.

The names and argument order are Horovod 0.28.1's. Operations are matched across ranks by name and run by a
background thread per process set (hpctrain/comm/negotiate.py), with fusion of small allreduces, mismatch
errors on every rank, `join`, and a stall inspector; `hpctrain launch` and `hpctrain submit` run the scripts.
What differs from Horovod and what is refused: docs/horovod.md.
"""

from __future__ import annotations

from . import elastic
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                       grouped_reducescatter, reducescatter)
from .basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                     global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
                     local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                     remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .handles import Adasum, Average, HorovodInternalError, Max, Min, Product, Sum
from .mpi_ops import (allgather_async, allreduce_, allreduce_async, allreduce_async_, alltoall_async, barrier,
                      broadcast_, broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async, join, poll,
                      reducescatter_async, sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "Product",
    "ProcessSet", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
