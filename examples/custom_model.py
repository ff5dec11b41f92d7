"""A custom model for `hpctrain train`: any file with a `factory(input_shape, num_classes) -> nn.Module`.

    hpctrain train --data data/ --run-dir runs/custom --model examples/custom_model.py:build
"""

import math

from torch import nn


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.block(x)


def build(input_shape, num_classes, width: int = 128, depth: int = 2) -> nn.Module:
    """A small residual MLP over the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                         *[Residual(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, num_classes))
