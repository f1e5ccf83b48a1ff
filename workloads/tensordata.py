"""A dataset split as in-memory tensors, and the error every dataset reader raises."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TensorData:
    x: torch.Tensor  # float32, normalised; images (n, C, H, W); tabular (n, d)
    y: torch.Tensor  # int64 labels (n,)
    num_classes: int
    groups: np.ndarray | None = None  # natural client id per example (synthetic, quadratic)

    def __len__(self) -> int:
        return int(self.y.shape[0])


class DatasetError(ValueError):
    """A dataset that is unknown, missing, malformed or asked for with bad parameters."""
