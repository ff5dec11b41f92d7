"""A model factory (`--model tests/mpi/scripts/stuck_stage.py:factory`, with --pp 2) whose first stage stops
sending in the third training step: it sleeps in its forward, so stage 1 waits for activations that never
come. The watchdog must name the stage and the rank it waits for."""

import time

import torch


class Stuck(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls > 2:
                time.sleep(3600)
        return x


def factory(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return torch.nn.Sequential(torch.nn.Flatten(), Stuck(), torch.nn.Linear(size, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, num_classes))
