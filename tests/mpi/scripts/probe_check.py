"""Under mpirun -n 2: the collectives a GradSync issues while it starts are the same on every rank, whatever
its device. A CUDA rank probes its MPI with one small allreduce from GPU memory; CPU ranks used to skip that
probe, so a job with a rank that sees no GPU mismatched every collective after it (no GPU here: the CPU ranks'
record is checked against the one allreduce the probe is)."""

from hpctrain.comm import Comm, GradSync, ZeroSync, world

import torch


class Recorder:
    """COMM_WORLD, recording the names of the collectives called on it."""

    def __init__(self, mpi):
        self._mpi, self.calls = mpi, []

    def __getattr__(self, name):
        attr = getattr(self._mpi, name)
        if callable(attr) and name[:1].isupper() and not name.startswith("Get_"):
            self.calls.append(name)
        return attr


base = world()
for make in (lambda c, m: GradSync(m.parameters(), c, overlap=False),
             lambda c, m: ZeroSync(m.parameters(), c, stage=1, overlap=False, reduce="allreduce")):
    recorder = Recorder(base.mpi)
    sync = make(Comm(recorder), torch.nn.Linear(4, 2))
    assert recorder.calls == ["Allreduce"], (base.rank, recorder.calls)
    sync.close()
print("PROBE OK", base.rank)
