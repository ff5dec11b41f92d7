"""The seed's mpi4py template, converted to hpctrain.

Changed lines are marked `# hpctrain`. What went away: the hand-written MPI setup and the per-parameter
`Allreduce` loop (a device->host copy, a blocking allreduce and a host->device copy per tensor, after
backward). What hpctrain does instead: fused zero-copy buckets whose allreduce starts during backward.
Two fixes to the seed itself: each rank reads its own slice of the data instead of overlapping ones, and
labels are class ids (the seed's `(1,)`-shaped targets make CrossEntropyLoss fail); the samples are fixed
per index with a learnable label, so the loss can fall.

    mpirun -n 2 python examples/seed_template.py [--epochs 10]
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset, Subset

import hpctrain  # hpctrain

ctx = hpctrain.init()  # hpctrain: MPI, rank, world size, device (replaces `comm = MPI.COMM_WORLD` ...)
rank, world_size = ctx.rank, ctx.world_size  # hpctrain


class CustomDataset(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, idx):
        x = torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(idx))
        return x, int(x[0].mean() > 0) + 2 * int(x[1].mean() > 0)  # 4 learnable classes


ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=10)
epochs = ap.parse_args().epochs
dataset = Subset(CustomDataset(), range(rank, 1000, world_size))  # hpctrain: this rank's share
dataloader = DataLoader(dataset, batch_size=32, shuffle=False)

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 26 * 26, 10)).to(ctx.device)  # hpctrain
hpctrain.broadcast_parameters(model)  # hpctrain: every rank starts from rank 0's weights
optimizer = hpctrain.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.01), model)  # hpctrain
loss_fn = nn.CrossEntropyLoss()

for epoch in range(epochs):
    total, batches = 0.0, 0
    for data, target in dataloader:
        data, target = data.to(ctx.device), target.to(ctx.device)  # hpctrain: the rank's own device
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()  # hpctrain: the gradient allreduce happens here and in step(); no manual loop
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    if rank == 0:
        print(f"epoch {epoch} loss {total / batches:.4f}", flush=True)
        torch.save(model.state_dict(), f"model_epoch{epoch}.pth")
print(f"rank {rank} in_sync {hpctrain.ranks_in_sync(model)}", flush=True)  # hpctrain: parameters equal on all ranks
