"""Run under mpirun -n N: facts about the comm layer that hold at any process count.

Each rank builds the same model, fills gradients with a known rank-dependent function through a real
backward, and checks that GradSync leaves exactly the sum over ranks in every .grad (as views of the
buckets, so no copy), in every mode given on the command line (`--device=cuda` for CUDA tensors).

Also importable: benchmarks/gpu_paths_worker.py calls `run(mode, comm, device)` for each of `MODES` on
the GPU, staged and CUDA-aware, and reads the returned (closed) GradSync's `staging`.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from hpctrain.comm import Comm, GradSync, world

MODES = ["blocking", "overlap", "fp16", "bf16", "hierarchical", "hierarchical-bf16", "deterministic",
         "deterministic-fp16", "accumulate"]


class Net(nn.Module):
    """Tied weights (emb used twice), an unused parameter, and one parameter larger than a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 16, bias=False)
        self.big = nn.Linear(16, 300)  # 4800 + 300 floats: larger than the 8 KiB buckets below
        self.head = nn.Linear(300, 4)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.big(self.emb(self.emb(x)))))


def run(mode: str, comm: Comm, device: str = "cpu") -> GradSync:
    """Check one mode's sums over `comm` on `device`; returns its GradSync, closed."""
    rank, size = comm.rank, comm.size
    torch.manual_seed(0)
    model = Net().to(device)
    comm.broadcast_tensors(model.parameters())
    kwargs = {"bucket_mb": 8 / 1024, "overlap": mode != "blocking",
              "compress": mode.split("-")[-1] if mode.endswith(("fp16", "bf16")) else "none",
              "hierarchical": mode.startswith("hierarchical"), "deterministic": mode.startswith("deterministic"),
              # emulate nodes of two ranks each on this one host
              "node_key": rank // 2 if mode.startswith("hierarchical") else None}
    sync = GradSync(model.parameters(), comm, **kwargs)
    results = []
    for step in range(3):
        sync.zero()
        per_rank = []
        for r in range(size):  # every rank computes every rank's gradient, to know the expected sum
            torch.manual_seed(1000 * step + r)
            x = torch.randn(8, 16).to(device)
            loss = model(x).pow(2).mean() * (r + 1)
            grads = torch.autograd.grad(loss, [p for n, p in model.named_parameters() if n != "unused.weight" and n != "unused.bias"])
            per_rank.append(grads)
        expected = [sum(g[i] for g in per_rank) for i in range(len(per_rank[0]))]
        torch.manual_seed(1000 * step + rank)
        x = torch.randn(8, 16).to(device)
        if mode == "accumulate":
            # two micro-batches whose gradients add up to the full one; sync only on the last
            with sync.no_sync():
                (model(x[:3]).pow(2).mean() * (rank + 1) * 3 / 8).backward()
            (model(x[3:]).pow(2).mean() * (rank + 1) * 5 / 8).backward()
        else:
            (model(x).pow(2).mean() * (rank + 1)).backward()
        handed = {id(p): p.grad.data_ptr() for b in sync.buckets if b.own for p in b.params if p.grad is not None}
        sync.wait()
        # a bucket of one large gradient is reduced in the memory autograd handed over: nothing copied
        assert handed and all(p.grad.data_ptr() == handed[id(p)] for b in sync.buckets if b.own
                              for p in b.params if id(p) in handed), "an own gradient was copied"
        results.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu())
        used = [p for n, p in model.named_parameters() if not n.startswith("unused")]
        tol = {"fp16": 2e-2, "bf16": 8e-2}.get(mode.split("-")[-1], 1e-5)
        for p, e in zip(used, expected):
            err = (p.grad - e).abs().max().item() / max(1e-6, e.abs().max().item())
            assert err <= tol, (mode, step, err)
        assert float(model.unused.weight.grad.abs().sum()) == 0.0
        # zero copy: every grad is a view into its bucket's storage
        for bucket in sync.buckets:
            base = bucket.flat.untyped_storage().data_ptr()
            for p in bucket.params:
                assert p.grad.untyped_storage().data_ptr() == base, "a gradient is not a view of its bucket"
    # with overlap, runs of backward order: the small gradients before and after the large one are two buckets;
    # without (summed together after backward), they are packed into one across it
    assert len(sync.buckets) == (3 if sync.overlap else 2), [[tuple(p.shape) for p in b.params] for b in sync.buckets]
    if mode.startswith("deterministic"):
        # the same bits on every rank
        everyone = comm.allgather(torch.cat(results).numpy().tobytes())
        assert all(e == everyone[0] for e in everyone)
    sync.close()
    return sync


def check_broadcast(comm: Comm) -> None:
    rank = comm.rank
    torch.manual_seed(rank)  # different on purpose
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7))
    model[1].running_mean.fill_(rank)
    comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    flat = torch.cat([t.detach().reshape(-1).float() for t in list(model.parameters()) + list(model.buffers())]).numpy()
    everyone = comm.allgather(flat)
    assert all(np.array_equal(everyone[0], f) for f in everyone)
    torch.manual_seed(0)
    assert np.array_equal(everyone[0][:35], nn.Linear(5, 7).weight.detach().reshape(-1).numpy())


def main(argv: list[str]) -> None:
    modes = [a for a in argv if not a.startswith("--device=")]
    device = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")), "cpu")
    comm = world()
    check_broadcast(comm)
    for mode in modes or MODES:
        run(mode, comm, device)
    comm.barrier()
    if comm.rank == 0:
        print("COMM OK", comm.size, device)


if __name__ == "__main__":
    main(sys.argv[1:])
