"""A model factory with buffers (`--model tests/mpi/scripts/buffers_model.py:build`): one BatchNorm1d between two
Linear layers, whose running statistics each rank updates from its own batch, and a module of its own that counts
its forwards in an integer buffer. Both stay equal on every rank only if hpctrain broadcasts them."""

import torch


class Counted(torch.nn.Module):
    """Counts the training forwards it ran (an int64 buffer), as BatchNorm's num_batches_tracked does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.seen += 1
        return x


def build(input_shape, num_classes):
    inputs = 1
    for d in input_shape:
        inputs *= d
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(inputs, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), Counted(), torch.nn.Linear(32, num_classes))
