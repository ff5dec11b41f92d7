"""Under mpirun -n 2: a healthy run whose validation pass or final checkpoint write is slower than
--collective-timeout must not be aborted by the watchdog (only waits on other ranks are collectives).

argv: DATA RUN MODE (validation | checkpoint). The slowness is injected here, in this process."""

import sys
import time
from pathlib import Path

import hpctrain.checkpoint.writer as ckpt  # the writer looks write_part up in its own namespace
from hpctrain.control import hybrid, trainer
from hpctrain.comm import world
from hpctrain.base.config import TrainConfig

data, run, mode = sys.argv[1:4]
comm = world()
if mode == "validation":
    evaluate = hybrid.evaluate  # the run's Parallel looks evaluate up in hybrid's namespace

    def slow_evaluate(model, reader, comm, **kw):
        time.sleep(5)  # a long validation pass: this rank's own work, on every rank
        return evaluate(model, reader, comm, **kw)

    hybrid.evaluate = slow_evaluate
else:
    write_part = ckpt.write_part

    def slow_write_part(path, *args):
        if comm.rank == 1:
            time.sleep(5)  # a slow parallel filesystem under rank 1's part
        return write_part(path, *args)

    ckpt.write_part = slow_write_part
# validation: a whole epoch, so that it runs inside the loop at the epoch's end, as in any real run
cfg = TrainConfig.flat(data=Path(data), run_dir=Path(run), epochs=1, max_steps=0 if mode == "validation" else 5,
                  collective_timeout=2.0,
                  checkpoint_every=0, progress=False)
summary = trainer.train(cfg, comm=comm)
print(f"rank {comm.rank} finished", flush=True)
