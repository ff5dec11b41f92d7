"""A model factory (`--model tests/mpi/scripts/stuck_stage.py:factory`, with --pp 2 --micro-batches 2) whose first
stage, on world rank 0 only, stops sending in its fifth forward (one at start-up, where the stages agree on shapes,
then two a step: micro-batch 1 of step 2): it sleeps in its forward, so stage 1 of its replica
waits for activations that never come (and, with two replicas, the other replica's ranks wait for it in the
data-parallel gradient sum). The watchdog must name the stage and the rank it waits for, and the flight
records lined up must name the transfer and the rank that never sent it."""

import os
import time

import torch


class Stuck(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls > 4 and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
                time.sleep(3600)
        return x


def factory(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return torch.nn.Sequential(torch.nn.Flatten(), Stuck(), torch.nn.Linear(size, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, num_classes))
