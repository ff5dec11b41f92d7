"""Train the same tiny GPT in many layouts (D, T, P) from one `mpirun -n 8`, each on a group of ranks split from
the world: one launch instead of one per layout (8 ranks on 2 cores start slowly). Phases run one after the
other; within a phase, disjoint groups of ranks run at the same time. The test compares the model.pt files.

    mpirun -n 8 python layouts_check.py TOKENS DIGITS OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hpctrain.base.config import TrainConfig
from hpctrain.comm import world
from hpctrain.control.trainer import train

DATA, DIGITS, OUT = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
MLP = dict(data=DIGITS, model="mlp:32,32", batch_size=16)  # an nn.Sequential: a pipeline of its children
COMMON = dict(data=DATA, model="gpt:layers=4,dim=32,heads=2", batch_size=8, max_steps=8, shuffle=False,
              optimizer="sgd", lr=0.05, checkpoint_every=0, progress=False, collective_timeout=120.0)


def phase(comm, runs: list[tuple[range, str, dict]]) -> None:
    """Each (ranks, name, options) trains on its ranks, at the same time as the others."""
    color = next((i for i, (ranks, _, _) in enumerate(runs) if comm.rank in ranks), None)
    sub = comm.split(color, comm.rank)
    if sub is not None:
        ranks, name, options = runs[color]
        train(TrainConfig.flat(run_dir=OUT / name, **{**COMMON, **options}), comm=sub)
    comm.barrier()


def main() -> None:
    comm = world()
    assert comm.size == 8, comm.size
    phase(comm, [(range(0, 2), "2-1-1", {}), (range(2, 3), "1-1-1", {}), (range(3, 4), "mlp-1-1-1", MLP),
                 (range(4, 8), "saved", dict(tp=2, max_steps=4, audit_samples=True))])
    phase(comm, [(range(0, 3), "mlp-1-1-3", dict(MLP, pp=3)), (range(3, 5), "plain-saved", dict(max_steps=4)),
                 (range(5, 7), "dropout-1-2-1", dict(tp=2, model="gpt:layers=2,dim=32,heads=2,dropout=0.1"))])
    phase(comm, [(range(0, 8), "2-2-2", dict(tp=2, pp=2, trace="3:6"))])  # and its timeline (test_parallel_mpi)
    phase(comm, [(range(0, 4), "2-2-1", dict(tp=2)), (range(4, 8), "2-1-2", dict(pp=2))])
    phase(comm, [(range(0, 4), "1-2-2", dict(tp=2, pp=2)), (range(4, 8), "1-1-4", dict(pp=4))])
    # data-parallel features inside the data-parallel group: ZeRO 2 with overlap on a pipeline (the tied
    # embedding/head a bucket alone), ZeRO 1 with the rank-ordered sum under tensor parallelism
    phase(comm, [(range(0, 4), "2-1-2-zero2", dict(pp=2, zero=2, overlap=True, micro_batches=3)),
                 (range(4, 8), "2-2-1-zero1-deterministic", dict(tp=2, zero=1, deterministic=True))])
    if comm.rank == 0:  # one checkpoint at (2,2,1), step 4, resumed in three other layouts
        shutil.copytree(OUT / "saved", OUT / "elastic")
        shutil.copytree(OUT / "saved", OUT / "to-plain")
    comm.barrier()
    # a data-parallel checkpoint resumed split, and a split one resumed by plain data parallelism
    phase(comm, [(range(0, 4), "plain-saved", dict(tp=2)), (range(4, 6), "to-plain", {})])
    phase(comm, [(range(0, 4), "saved", dict(pp=2, audit_samples=True)),
                 (range(4, 8), "elastic", dict(pp=4, max_steps=0, epochs=1, audit_samples=True,
                                                 pipeline_schedule="gpipe"))])


if __name__ == "__main__":
    main()
