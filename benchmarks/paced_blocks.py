"""A model of 8 blocks of fixed duration, for measuring a pipeline schedule's bubble where ranks share cores.

    hpctrain bench train -n 4 --pp 4 --micro-batches 8 --model benchmarks/paced_blocks.py:factory

Each block's forward takes FORWARD_S and its backward BACKWARD_S (a sleep, then a small matmul), whatever
else runs on the machine: the stages are as even as a pipeline's ideal, and 4 ranks on 2 cores do not slow
each other, so the measured bubble is the schedule's (and the transfers'), not the contention's. It stands in
for compute-bound stages (stage time far above transfer time) on a machine with fewer cores than ranks; on
one core per rank, measure the built-in GPT instead.
"""

import time

import torch

FORWARD_S, BACKWARD_S = 0.005, 0.010
BLOCKS, WIDTH = 8, 64


class _Paced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad


class PacedBlock(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, flatten: bool = False):
        super().__init__()
        self.flatten = flatten
        self.linear = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        if self.flatten:
            x = x.reshape(len(x), -1)
        return _Paced.apply(self.linear(x))


def factory(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    blocks = [PacedBlock(size, WIDTH, flatten=True)]
    blocks += [PacedBlock(WIDTH, WIDTH) for _ in range(BLOCKS - 2)]
    blocks.append(PacedBlock(WIDTH, num_classes))
    return torch.nn.Sequential(*blocks)
