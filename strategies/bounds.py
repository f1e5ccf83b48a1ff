"""Sanity bounds on update norms: what a reply may change before it is rejected.

Default bounds (measured): honest update norms in 12–15-round in-process runs (digits and
quadratic workloads; the fedawe-table2 CNN, fedexp-fedaware, fdms-clustered and fednova presets:
FedAvg, MIFA, FedExP, Stale, FedNova with momentum 0.9 and Dirichlet-0.1 data sizes) were at
most 25 and at most 3.4 times the round's median. FedAWE's raw ‖x_i^† − x^t‖ (the client's stale
copy plus the echo factor t − τ_i) reached 157 and 68 times the median in 12 rounds, which is why
FedAWE bounds its client's own step ‖u_i‖ / (t − τ_i) instead (at most 3.9 times the median in 15
digits rounds). ``max_update_norm = 1e6`` and ``max_norm_ratio = 1e3`` leave orders of magnitude
of margin above all of these and still reject what breaks float32 rules (norms ≳ 1e19 overflow a
float32 sum of squares or Gram matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

R = TypeVar("R")


@dataclass(frozen=True)
class NormBounds:
    """The absolute cap and the ratio test on update norms.

    max_update_norm : a reply whose update norm exceeds this is rejected; 0 = no absolute cap.
        Spec key ``max-update-norm``.
    max_norm_ratio : with at least 3 replies left under the cap, a reply whose update norm
        exceeds this multiple of the round's median update norm is rejected; 0 = off. Spec key
        ``max-norm-ratio`` (e.g. ``mifa:max-norm-ratio=50``).
    """

    max_update_norm: float = 1e6
    max_norm_ratio: float = 1e3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_update_norm) and self.max_update_norm >= 0):
            raise ValueError(f"max_update_norm (spec key max-update-norm) must be a finite number >= 0 "
                             f"(0 = no cap), got {self.max_update_norm}")
        if not (math.isfinite(self.max_norm_ratio) and (self.max_norm_ratio == 0 or self.max_norm_ratio > 1)):
            raise ValueError(f"max_norm_ratio (spec key max-norm-ratio) must be a finite number > 1 "
                             f"(0 = off), got {self.max_norm_ratio}")

    def check(self, reports: list[R], norm_of: Callable[[R], float], node_of: Callable[[R], int],
              reject: Callable[[int, str], None]) -> list[R]:
        """The reports within the bounds; the others go to ``reject`` with the reason.

        First the absolute cap ``max_update_norm`` (and a non-finite norm); then, among the reports
        under it and only when at least 3 remain, ``max_norm_ratio`` × their median norm (a median
        of 1 or 2 norms says nothing about which one is wrong; a zero median gives no scale, so no
        ratio test). The round's own median needs no history, so the first round is checked like
        any other.
        """
        under = []
        for r in reports:
            norm = norm_of(r)
            if self.max_update_norm and norm > self.max_update_norm:  # inf included
                reject(node_of(r), f"update norm {norm:.2g} > max-update-norm {self.max_update_norm:.2g}")
            elif not math.isfinite(norm):
                reject(node_of(r), f"update norm {norm} is not finite")
            else:
                under.append((r, norm))
        median = float(np.median([n for _, n in under])) if len(under) >= 3 else 0.0
        if not (self.max_norm_ratio and median > 0):
            return [r for r, _ in under]
        kept = []
        for r, norm in under:
            if norm > self.max_norm_ratio * median:
                reject(node_of(r), f"update norm {norm:.2g} > max-norm-ratio {self.max_norm_ratio:g} "
                                   f"x the round's median {median:.2g}")
            else:
                kept.append(r)
        return kept
