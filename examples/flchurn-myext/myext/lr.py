"""Recipe: a learning-rate schedule, a function of the 0-based round t and the run's base lr.
Linear warm-up over ``warmup`` rounds, then a cosine decay to ``floor`` x lr at round ``rounds``
(Goyal et al., 2017, Sec. 2.2; Loshchilov & Hutter, ICLR 2017, Eq. 5).

Reached as ``lr-schedule = "myext.lr:warmup_cosine:warmup=2,rounds=20"``, or, installed,
``lr-schedule = "warmup-cosine:warmup=2,rounds=20"``.
"""

from __future__ import annotations

import math


def warmup_cosine(t: int, base_lr: float, warmup: int = 5, rounds: int = 100, floor: float = 0.01) -> float:
    if t < warmup:
        return base_lr * (t + 1) / warmup
    progress = min(1.0, (t - warmup) / max(1, rounds - warmup))
    return base_lr * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
