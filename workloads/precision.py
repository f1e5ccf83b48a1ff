"""Local training in exact float32 on a GPU: the arithmetic both engines train in.

PyTorch's defaults on a CUDA device round a convolution's inputs to TF32 (10-bit mantissa,
``torch.backends.cudnn.allow_tf32 = True``) and let cuDNN pick nondeterministic algorithms. Then
a client's update depends on which kernel ran: the per-client engine's convolution and the cohort
engine's vmapped (grouped) one round differently by ~1e-3 per layer, and the per-client engine
rerun on one start gives another model (measured on an H200, CIFAR-10 ``cnn``, round 1: the
engines 4.7e-2 apart on a client whose own sensitivity to a 1e-7 start is 4.0e-6, and the
per-client engine rerun on one start not bit-identical on any of 20 clients, the round's model
2.1e-2 apart at lr 0.05; ``benchmarks/engine_agreement.py``). :func:`exact_float32` turns both off for the
duration of local training (IEEE float32 convolutions and matrix products, deterministic cuDNN
algorithms) and restores the caller's settings; on a CPU it changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def exact_float32(device: torch.device) -> Iterator[None]:
    """IEEE float32 (no TF32) and deterministic cuDNN while the block trains on ``device``."""
    if device.type != "cuda":
        yield
        return
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = False, False, True, False
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved
