"""A model factory (`--model tests/mpi/scripts/uneven_model.py:factory`) whose rank 1 is slow in its own work: 3 s
longer to build (as on a busy node: imports, allocations) and 3 s longer in its first validation pass. Healthy,
only uneven: the other ranks wait for it in the next collective, and no steady-state deadline may end the job."""

import os
import time

import torch

SLOW = os.environ.get("OMPI_COMM_WORLD_RANK") == "1"


class Uneven(torch.nn.Module):
    def __init__(self, inputs: int, classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(inputs, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, classes))
        self.slow_validation = SLOW

    def forward(self, x):
        if not self.training and self.slow_validation:
            self.slow_validation = False
            time.sleep(3)
        return self.net(x)


def factory(input_shape, num_classes):
    if SLOW:
        time.sleep(3)
    size = 1
    for d in input_shape:
        size *= d
    return Uneven(size, num_classes)
