"""A model factory (`--model tests/mpi/scripts/failing_model.py:factory`) whose forward raises on rank 1 at its
third training step: an unexpected error (a bug in user code), not an HpctrainError."""

import os

import torch


class Failing(torch.nn.Linear):
    calls = 0

    def forward(self, x):
        Failing.calls += 1
        if self.training and Failing.calls == 3 and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
            raise ZeroDivisionError("a bug in the user's forward")
        return super().forward(x.flatten(1))


def factory(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return Failing(size, num_classes)
