"""Under mpirun -n 2: a language-model run whose start-up measurement of the peak FLOP/s takes one rank far
longer than the collective timeout and the start-up budget (a loaded node) must not be aborted: measuring is
each rank's own work, not a hang. The slowness is injected here, in rank 1's process.

argv: DATA RUN SECONDS (how long rank 1's measurement takes)."""

import sys
import time
from pathlib import Path

import hpctrain.base.stop as stop
import hpctrain.compute.gpt as gpt  # control/lm looks measure_peak_flops up in gpt's namespace
from hpctrain.base.config import TrainConfig
from hpctrain.comm import world
from hpctrain.control import trainer

data, run, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
comm = world()
stop.EDGE_FLOOR_S = seconds / 2  # the start-up budget (at least a minute in use), shorter than the slow measurement
measure = gpt.measure_peak_flops


def slow_measure(*args, **kw):
    if comm.rank == 1:
        time.sleep(seconds)  # a rank starved of CPU while it times its matmuls
    return measure(*args, **kw)


gpt.measure_peak_flops = slow_measure
cfg = TrainConfig.flat(data=Path(data), run_dir=Path(run), model="gpt:layers=1,dim=32,heads=2", max_steps=3,
                  batch_size=8, collective_timeout=2.0, checkpoint_every=0, progress=False)
summary = trainer.train(cfg, comm=comm)
print(f"rank {comm.rank} finished, peak {summary['peak_flops']:.3g}", flush=True)
