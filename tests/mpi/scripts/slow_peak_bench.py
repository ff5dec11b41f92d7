"""Under mpirun -n 2: `hpctrain bench train` of a language model whose peak-FLOP/s measurement takes rank 1
far longer than the collective timeout and the start-up budget (a loaded node) must not be aborted: the
bench measures through the same code as `train`. The slowness is injected here, in rank 1's process.

argv: SECONDS (how long rank 1's measurement takes)."""

import sys
import time

import hpctrain.base.stop as stop
import hpctrain.compute.gpt as gpt  # control/lm looks measure_peak_flops up in gpt's namespace
from hpctrain.bench.train import bench_train
from hpctrain.bench.watch import watched

seconds = float(sys.argv[1])
stop.EDGE_FLOOR_S = seconds / 2  # the start-up budget (at least a minute in use), shorter than the slow measurement
measure = gpt.measure_peak_flops


def slow_measure(*args, **kw):
    if rank == 1:
        time.sleep(seconds)  # a rank starved of CPU while it times its matmuls
    return measure(*args, **kw)


gpt.measure_peak_flops = slow_measure
with watched(2.0) as comm:
    rank = comm.rank
    result = bench_train(comm, model_spec="gpt:layers=1,dim=32,heads=2", seq_len=16, batch_size=4, steps=2, rounds=1,
                         baseline=None)
print(f"rank {rank} finished, peak {result['peak_flops']:.3g}", flush=True)
