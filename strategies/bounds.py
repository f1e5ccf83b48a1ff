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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

R = TypeVar("R")


HISTORY = 64  # accepted norms the running median remembers (across rounds)


@dataclass
class NormBounds:
    """The absolute cap and the ratio test on update norms, with a running median.

    max_update_norm : a reply whose update norm exceeds this is rejected; 0 = no absolute cap.
        Spec key ``max-update-norm``.
    max_norm_ratio : a reply whose update norm exceeds this multiple of the reference median is
        rejected; 0 = off. Spec key ``max-norm-ratio`` (e.g. ``mifa:max-norm-ratio=50``). The
        reference is the median of the last ``HISTORY`` accepted norms (earlier rounds) together
        with this round's norms under the cap, once there are at least 3 of them; so a round with
        1 or 2 replies is bounded by the history, and the first round is checked against its own
        median (3+ replies) or by the absolute cap alone (1-2 replies, no history yet).
    """

    max_update_norm: float = 1e6
    max_norm_ratio: float = 1e3
    history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY), compare=False, repr=False)
    _pending: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

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

        First the absolute cap ``max_update_norm`` (and a norm that is not a finite number, or
        whose computation raised); then ``max_norm_ratio`` × the median of the recently accepted
        norms and this round's norms under the cap, when there are at least 3 of them (a median of
        1 or 2 norms says nothing about which one is wrong; a zero median gives no scale, so no
        ratio test). The accepted norms join the history.
        """
        under = []
        for r in reports:
            try:
                norm = float(norm_of(r))
            except Exception as exc:  # noqa: BLE001 (one reply, one verdict)
                reject(node_of(r), f"update norm cannot be computed: {type(exc).__name__}: {exc}")
                continue
            if self.max_update_norm and norm > self.max_update_norm:  # inf included
                reject(node_of(r), f"update norm {norm:.2g} > max-update-norm {self.max_update_norm:.2g}")
            elif not math.isfinite(norm):
                reject(node_of(r), f"update norm {norm} is not finite")
            else:
                under.append((r, norm))
        pool = [*self.history, *(n for _, n in under)]
        median = float(np.median(pool)) if len(pool) >= 3 else 0.0
        kept = []
        for r, norm in under:
            if self.max_norm_ratio and median > 0 and norm > self.max_norm_ratio * median:
                reject(node_of(r), f"update norm {norm:.2g} > max-norm-ratio {self.max_norm_ratio:g} "
                                   f"x the median of recent norms {median:.2g}")
            else:
                kept.append(r)
                self._pending[id(r)] = norm
        return kept

    def commit(self, accepted: list[Any]) -> None:
        """The reports finally accepted this round (among those :meth:`check` kept): their norms
        join the history of the running median."""
        self.history.extend(self._pending[id(r)] for r in accepted if id(r) in self._pending)
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=HISTORY)
