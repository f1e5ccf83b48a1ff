"""pfl-research's ``simple_cnn`` (benchmarks/model/pytorch/cnn.py in apple/pfl-research), as a
user's model factory ``factory(input_shape, num_classes)`` given by ``module:attr`` (issue 49):
two 3x3 convolutions (32, 64), a 2x2 max-pool, dropout 0.25, a 128-unit dense layer, dropout 0.5,
PyTorch's default initialisation."""

from __future__ import annotations

from torch import nn


def simple_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    flat = ((h - 4) // 2) * ((w - 4) // 2) * 64
    return nn.Sequential(nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2, 2),
                         nn.Dropout(0.25), nn.Flatten(), nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(128, num_classes))
