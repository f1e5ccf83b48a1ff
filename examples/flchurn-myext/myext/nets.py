"""Recipe: a model. Any factory(input_shape, num_classes, **params) -> torch.nn.Module."""

import math

from torch import nn


def tiny_mlp(input_shape: tuple[int, ...], num_classes: int, width: int = 32, depth: int = 1) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    size = math.prod(input_shape)
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, num_classes))
