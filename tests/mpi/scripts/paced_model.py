"""A model factory (`--model tests/mpi/scripts/paced_model.py:factory`) whose training steps take at least 25 ms:
a test that signals a run at a chosen step then lands inside the epoch it means even when the test's own
process gets little CPU (a loaded node: ranks that busy-poll in MPI starve it)."""

import time

import torch


class Paced(torch.nn.Module):
    def __init__(self, inputs: int, classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(inputs, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, classes))

    def forward(self, x):
        if self.training:
            time.sleep(0.025)
        return self.net(x)


def factory(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return Paced(size, num_classes)
